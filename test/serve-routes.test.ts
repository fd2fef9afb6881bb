/**
 * MoE routing replay at the gateway: the experts an engine routed each token to (vLLM's `routed_experts`, SGLang's
 * `sgl_ext.routed_experts`), streamed or not, recorded with the call token for token, durable across a kill -9 and
 * through the shared pool, handed to the packer as the records' `routes`, and kept from the agent unless it asked.
 * Routes that cannot be recorded (another length than the call's tokens, too large, a flat array of no known shape)
 * leave the call answered and recorded without them, counted and warned about naming the call and the field. They are
 * checked on a thread of their own (routes-thread.ts): the event loop goes on meanwhile.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { readMicroBatch } from '../src/io/microbatch.js';
import { parseRecords } from '../src/records/read.js';
import type { Sample } from '../src/records/types.js';
import { Service, type ServiceOptions } from '../src/serve/service.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import type { TextTokenizer } from '../src/index.js';
import { redisAvailable, startRedis, type RedisServer } from './helpers/redis.js';
import { startServeProcess, tempDir, type ServeProcess } from './helpers/serve.js';
import { recordRoutes, RoutesDropped, type RawRoutes, type RecordedRoutes, type RouteOptions } from '../src/serve/routed-experts.js';
import { RoutesThread } from '../src/serve/routes-thread.js';
import { npyBase64, startStubEngine, stubRoutes, type StubEngine, type StubRoutes } from './helpers/stub-engine.js';

type Obj = Record<string, unknown>;
const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

const SHAPE = { layers: 3, topK: 2, experts: 8 };
const VLLM: StubRoutes = { form: 'vllm', ...SHAPE };
const SGLANG: StubRoutes = { form: 'sglang', ...SHAPE };

interface Output {
  promptTokenIds: number[];
  tokenIds: number[];
  routes?: { dtype: string; shape: number[]; data: string };
}
interface Call {
  id: string;
  output: Output;
  siblings?: Output[];
}

/** The routes an output should carry: every token but the last, as the stub routes them. */
function expected(o: Output): Obj {
  const ids = [...o.promptTokenIds, ...o.tokenIds].slice(0, -1);
  const v = Int16Array.from(stubRoutes(ids, SHAPE));
  return { dtype: 'int16', shape: [ids.length, SHAPE.layers, SHAPE.topK], data: Buffer.from(v.buffer).toString('base64') };
}

async function episode(base: string, ep: string): Promise<{ calls: Call[] }> {
  const r = await fetch(`${base}/v1/episodes/${ep}`);
  expect(r.status).toBe(200);
  return (await r.json()) as { calls: Call[] };
}

/** Drains an SSE answer into its text. */
const text = (r: Response) => r.text();

describe('routed experts at the gateway', { timeout: 120_000 }, () => {
  let tok: TextTokenizer;
  const engines: StubEngine[] = [];
  const services: Service[] = [];
  beforeAll(async () => {
    tok = await loadTokenizer('qwen3');
  });
  afterEach(async () => {
    for (const s of services.splice(0)) await s.close();
    for (const e of engines.splice(0)) await e.close();
  });

  async function start(routes: StubRoutes | undefined, opts: Partial<ServiceOptions> = {}) {
    const stub = await startStubEngine('ok', { tokenizer: tok, record: true, routes });
    engines.push(stub);
    const warnings: string[] = [];
    const svc = await Service.create({
      engineUrl: stub.url,
      dataDir: tempDir('tp-routes-'),
      port: 0,
      packer: { tokenizer: 'qwen3' },
      warn: (m) => warnings.push(m),
      ...opts,
    });
    services.push(svc);
    return { stub, svc, base: await svc.listen(), warnings };
  }

  async function calls(base: string, ep: string, extra: Obj = {}): Promise<Obj[]> {
    const msgs = [{ role: 'user', content: `hello ${ep}` }];
    const answers: Obj[] = [];
    for (const stream of [false, true]) {
      const chat = await post(`${base}/episodes/${ep}/v1/chat/completions`, { messages: msgs, stream, n: 2, ...extra });
      expect(chat.status).toBe(200);
      const cmpl = await post(`${base}/episodes/${ep}/v1/completions`, { prompt: `count ${ep}`, stream, ...extra });
      expect(cmpl.status).toBe(200);
      for (const r of [chat, cmpl]) answers.push(stream ? { sse: await text(r) } : ((await r.json()) as Obj));
    }
    return answers;
  }

  for (const [name, routes, opts] of [
    ['vLLM (.npy in choices[].routed_experts)', VLLM, {}],
    ['SGLang (flat int32 in choices[].sgl_ext.routed_experts, asked for)', SGLANG, { recordRoutes: true, routeShape: [3, 2] }],
  ] as const) {
    it(`${name}: recorded token for token, streamed and not, every choice; the agent sees them only when it asks`, async () => {
      const { stub, base, warnings } = await start(routes, opts);
      const answers = await calls(base, 'ep-r');
      for (const a of answers) expect(JSON.stringify(a)).not.toMatch(/routed_experts|sgl_ext/);
      // asked for with --record-routes only
      for (const r of stub.requests) expect(r.return_routed_experts).toBe(routes.form === 'sglang' ? true : undefined);
      const { calls: recorded } = await episode(base, 'ep-r');
      const outputs = recorded.flatMap((c) => [c.output, ...(c.siblings ?? [])]);
      expect(outputs).toHaveLength(6); // two chat calls of n = 2, two completions
      for (const o of outputs) expect(o.routes).toEqual(expected(o));
      expect(warnings).toEqual([]);

      // the packer's input: every routed call a pre-tokenized sample (the engine's tokens), its routes read by the
      // record parser
      const finish = await post(`${base}/v1/episodes/ep-r/finish`, { reward: 1 });
      expect(finish.status).toBe(200);
      const lines = (await (await fetch(`${base}/v1/episodes/ep-r/records`)).text())
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l) as Obj);
      expect(lines).toHaveLength(6);
      lines.forEach((line, i) => {
        const [s] = parseRecords(line, { file: 'records', line: i + 1 }) as Sample[];
        const o = outputs[i];
        expect([...s.tokens]).toEqual([...o.promptTokenIds, ...o.tokenIds]);
        const want = stubRoutes([...s.tokens].slice(0, -1), SHAPE);
        expect([...s.routes!.experts]).toEqual([...want, ...new Array<number>(SHAPE.layers * SHAPE.topK).fill(-1)]);
      });
      // the feed's micro-batch: each node's row is the route of its token at its position, or unrouted (-1)
      const res = await fetch(`${base}/v1/batches/next?wait=60`);
      expect(res.status).toBe(200);
      expect(((await (await fetch(`${base}/v1/feed`)).json()) as { quarantined: number }).quarantined).toBe(0);
      const file = join(tempDir('tp-routes-mb-'), 'mb.safetensors');
      writeFileSync(file, Buffer.from(await res.arrayBuffer()));
      const { batch } = readMicroBatch(file);
      expect([batch.meta.routes_layers, batch.meta.routes_top_k]).toEqual([SHAPE.layers, SHAPE.topK]);
      const row = SHAPE.layers * SHAPE.topK;
      let routed = 0;
      for (let i = 0; i < batch.input_ids.length; i++) {
        const got = [...batch.routes!.subarray(i * row, (i + 1) * row)];
        if (got.every((x) => x === -1)) continue;
        routed++;
        expect(got).toEqual([...stubRoutes([batch.input_ids[i]], SHAPE, batch.position_ids[i])]);
      }
      expect(routed).toBeGreaterThan(batch.input_ids.length / 2);
      // an agent that asks sees them
      const asked = await post(`${base}/episodes/ep-ask/v1/chat/completions`, {
        messages: [{ role: 'user', content: 'hi' }],
        return_routed_experts: true,
      });
      const choice = ((await asked.json()) as { choices: Obj[] }).choices[0];
      expect(typeof (routes.form === 'vllm' ? choice.routed_experts : (choice.sgl_ext as Obj).routed_experts)).toBe('string');
    });
  }

  it("a routed chat call keeps its messages: each one's start and author, its agent, and its turn in the micro-batch", async () => {
    const { base } = await start(VLLM, { packer: { tokenizer: 'qwen3', turnIds: true } });
    const messages = [
      { role: 'system', content: 'be brief' },
      { role: 'user', content: 'first question' },
      { role: 'assistant', content: 'first answer' },
      { role: 'user', content: 'second question' },
    ];
    const r = await fetch(`${base}/episodes/ep-m/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-treepack-agent': 'solver' },
      body: JSON.stringify({ messages }),
    });
    expect(r.status).toBe(200);
    expect((await post(`${base}/v1/episodes/ep-m/finish`, { reward: 1 })).status).toBe(200);
    const [line] = (await (await fetch(`${base}/v1/episodes/ep-m/records`)).text())
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as Obj);
    const [s] = parseRecords(line, { file: 'records', line: 1 }) as Sample[];
    expect(s.routes).toBeDefined();
    expect(s.agent).toBe('solver');
    // Qwen3's template opens every message's turn with <|im_start|>: the prompt's five of them (the response's
    // header is the last) are where the messages start
    const IM_START = 151644;
    const prompt = [...s.tokens].slice(0, s.loss_mask.indexOf(1));
    const starts = prompt.flatMap((t, i) => (t === IM_START ? [i] : []));
    expect(starts).toHaveLength(5);
    expect([...s.message_offsets!]).toEqual(starts);
    expect(s.message_authors).toEqual(['initialization', 'user', 'env', 'user', 'llm']);
    // the micro-batch's turn ids: -1 before the response's turn, 0 from its header on (not one turn throughout)
    const res = await fetch(`${base}/v1/batches/next?wait=60`);
    expect(res.status).toBe(200);
    const file = join(tempDir('tp-routes-turns-'), 'mb.safetensors');
    writeFileSync(file, Buffer.from(await res.arrayBuffer()));
    const { batch } = readMicroBatch(file);
    expect(batch.turn_ids).toBeDefined();
    expect([...batch.turn_ids!]).toEqual([...s.tokens].map((_, i) => (i < starts[4] ? -1 : 0)));
  });

  it('routes that cannot be recorded: the call is answered and recorded without them, counted, warned once naming call and field', async () => {
    // one row short of the call's tokens
    const short = await start({ ...VLLM, short: true });
    expect((await post(`${short.base}/episodes/ep-s/v1/chat/completions`, { messages: [{ role: 'user', content: 'hi' }] })).status).toBe(
      200,
    );
    expect((await post(`${short.base}/episodes/ep-s/v1/chat/completions`, { messages: [{ role: 'user', content: 'hey' }] })).status).toBe(
      200,
    );
    const [c0] = (await episode(short.base, 'ep-s')).calls;
    expect(c0.output.routes).toBeUndefined();
    const n = c0.output.promptTokenIds.length + c0.output.tokenIds.length;
    expect(short.warnings).toEqual([
      `call ${c0.id}: the engine's routed experts were not recorded (length): field "choices[0].routed_experts.shape[0]": ` +
        `expected routes for ${n} tokens (or ${n - 1}: the last token unrouted), got ${n - 2}; the call is recorded without them. ` +
        'treepack_engine_routes_dropped_total counts such outputs',
    ]);
    expect(await (await fetch(`${short.base}/metrics`)).text()).toContain('treepack_engine_routes_dropped_total{reason="length"} 2');

    // a flat array (SGLang) with no --route-shape; routes over --max-route-bytes
    const flat = await start(SGLANG, { recordRoutes: true });
    expect((await post(`${flat.base}/episodes/ep-f/v1/completions`, { prompt: 'x' })).status).toBe(200);
    expect(flat.warnings[0]).toMatch(/\(no_shape\): field "choices\[0\]\.sgl_ext\.routed_experts": .*--route-shape LAYERS,TOPK/);
    const big = await start(VLLM, { maxRouteBytes: 16 });
    expect((await post(`${big.base}/episodes/ep-b/v1/completions`, { prompt: 'x' })).status).toBe(200);
    expect(big.warnings[0]).toMatch(
      /\(too_large\): field "choices\[0\]\.routed_experts": \d+ tokens × 3 layers × 2 experts take \d+ bytes/,
    );
    for (const [s, ep] of [
      [flat, 'ep-f'],
      [big, 'ep-b'],
    ] as const)
      expect((await episode(s.base, ep)).calls[0].output.routes).toBeUndefined();
  });

  it('an engine that returns none records none: asked with --record-routes, it ignores the field', async () => {
    const { stub, base, warnings } = await start(undefined, { recordRoutes: true });
    await calls(base, 'ep-n');
    for (const c of (await episode(base, 'ep-n')).calls) expect(c.output.routes).toBeUndefined();
    for (const r of stub.requests) expect(r.return_routed_experts).toBe(true);
    expect(warnings).toEqual([]);
    expect(await (await fetch(`${base}/metrics`)).text()).not.toMatch(/treepack_engine_routes_dropped_total\{/);
  });
});

describe('routed experts are durable', { timeout: 180_000 }, () => {
  let stub: StubEngine;
  let proc: ServeProcess | undefined;
  beforeAll(async () => {
    stub = await startStubEngine('ok', { tokenizer: await loadTokenizer('qwen3'), routes: VLLM });
  });
  afterEach(async () => {
    await proc?.kill9();
    proc = undefined;
  });
  afterAll(async () => {
    await stub?.close();
  });

  it('across a kill -9 of the service, token for token', async () => {
    // a log compacted as it grows: its rewrite keeps the routes too
    const dir = tempDir('tp-routes-kill-');
    const args = ['--engine', stub.url, '--data', dir, '--tokenizer', 'qwen3', '--compact-bytes', '1'];
    proc = await startServeProcess(args);
    for (let i = 0; i < 3; i++) {
      const r = await post(`${proc.url}/episodes/ep-k/v1/chat/completions`, {
        messages: [{ role: 'user', content: `turn ${i}` }],
        stream: i === 1,
      });
      expect(r.status).toBe(200);
      await r.text();
    }
    // a compaction (in a worker) is swapped in at a later write: calls of another episode until it was
    const compacted = () => readFileSync(join(dir, 'events.jsonl'), 'utf8').startsWith('{"type":"snapshot"');
    for (let i = 0; i < 100 && !compacted(); i++) {
      await post(`${proc.url}/episodes/ep-pad/v1/completions`, { prompt: `pad ${i}` }).then((r) => r.text());
      await new Promise((r) => setTimeout(r, 200));
    }
    expect(compacted()).toBe(true);
    const before = (await episode(proc.url, 'ep-k')).calls;
    await proc.kill9();
    proc = await startServeProcess(args);
    const after = (await episode(proc.url, 'ep-k')).calls;
    expect(after).toHaveLength(3);
    for (const c of after) expect(c.output.routes).toEqual(expected(c.output));
    expect(after.map((c) => c.output.routes)).toEqual(before.map((c) => c.output.routes));
  });
});

describe.skipIf(!redisAvailable('serve-routes (shared pool)'))('routed experts through the shared pool', { timeout: 120_000 }, () => {
  let redis: RedisServer;
  let stub: StubEngine;
  let svc: Service | undefined;
  beforeAll(async () => {
    redis = await startRedis();
    stub = await startStubEngine('ok', { tokenizer: await loadTokenizer('qwen3'), routes: VLLM });
  });
  afterAll(async () => {
    await svc?.close();
    await stub?.close();
    await redis?.stop();
  });

  it('a finished episode shipped to Redis keeps its calls routes', async () => {
    svc = await Service.create({
      engineUrl: stub.url,
      dataDir: tempDir('tp-routes-redis-'),
      port: 0,
      redis: redis.url,
      packer: { tokenizer: 'qwen3' },
    });
    const base = await svc.listen();
    expect((await post(`${base}/episodes/ep-x/v1/chat/completions`, { messages: [{ role: 'user', content: 'hi' }] })).status).toBe(200);
    expect((await post(`${base}/v1/episodes/ep-x/finish`, { reward: 1 })).status).toBe(200);
    const [ep] = await svc.recorder.shared!.groupEpisodes('ep-x');
    expect(ep.calls).toHaveLength(1);
    const o = ep.calls[0].output as unknown as Output;
    expect(o.routes).toEqual(expected(o));
  });
});

describe('the engines forms of routes', () => {
  const opts = { maxBytes: 1 << 20 };
  const ids = [5, 9, 2, 7];
  const want = stubRoutes(ids.slice(0, 3), SHAPE);
  const record = (v: Int32Array) => ({
    dtype: 'int16',
    shape: [v.length / 6, 3, 2],
    data: Buffer.from(Int16Array.from(v).buffer).toString('base64'),
  });

  it("vLLM 0.21's prompt rows apart (prompt_routed_experts) are joined to the generated ones; JSON arrays and int16 .npy read", () => {
    const npy16 = (v: Int32Array, rows: number) => {
      const b = Buffer.from(npyBase64(v, [rows, 3, 2]), 'base64');
      // the same array as int16: descr '<i2', half the data
      const header = b
        .subarray(0, b.length - v.length * 4)
        .toString('latin1')
        .replace("'<i4'", "'<i2'");
      return Buffer.concat([Buffer.from(header, 'latin1'), Buffer.from(Int16Array.from(v).buffer)]).toString('base64');
    };
    const split = recordRoutes(
      {
        value: npy16(want.subarray(12), 1),
        field: 'choices[0].routed_experts',
        prompt: { value: npy16(want.subarray(0, 12), 2), field: 'prompt_routed_experts' },
      },
      4,
      opts,
    );
    expect(split).toEqual(record(want));
    const nested = [...Array(3).keys()].map((t) => [...Array(3).keys()].map((l) => [want[t * 6 + l * 2], want[t * 6 + l * 2 + 1]]));
    expect(recordRoutes({ value: nested, field: 'choices[0].routed_experts' }, 4, opts)).toEqual(record(want));
  });

  it('a 32k-token call of 48 layers, top-8: recorded (the record parser checks its 32 MiB of base64 in one scan)', () => {
    const shape = { layers: 48, topK: 8, experts: 128 };
    const tokens = Array.from({ length: 32768 }, (_, i) => (i * 7919) % 150000);
    const v = stubRoutes(tokens.slice(0, -1), shape);
    const r = recordRoutes({ value: npyBase64(v, [32767, 48, 8]), field: 'f' }, 32768, { maxBytes: 64 << 20 });
    expect(r.shape).toEqual([32767, 48, 8]);
    expect(Buffer.from(r.data, 'base64').equals(Buffer.from(Int16Array.from(v).buffer))).toBe(true);
  });

  it('refused naming the field: big-endian .npy, an expert int16 cannot hold, a repeated expert', () => {
    const be = Buffer.from(npyBase64(want, [3, 3, 2]), 'base64')
      .toString('latin1')
      .replace("'<i4'", "'>i4'");
    expect(() => recordRoutes({ value: Buffer.from(be, 'latin1').toString('base64'), field: 'f' }, 4, opts)).toThrow(
      'field "f": a NumPy array of dtype ">i4": expected little-endian integers',
    );
    const big = want.slice();
    big[7] = 70000;
    expect(() => recordRoutes({ value: npyBase64(big, [3, 3, 2]), field: 'f' }, 4, opts)).toThrow(
      /^field "f\[1\]\[0\]\[1\]": expected an expert id \(an integer in 0\.\.32767\), got 70000$/,
    );
    const twice = want.slice();
    twice[1] = twice[0];
    expect(() => recordRoutes({ value: npyBase64(twice, [3, 3, 2]), field: 'f' }, 4, opts)).toThrow(
      /^field "f\[0\]\[0\]": expert \d+ is routed twice/,
    );
  });
});

describe('the routes thread: routes checked off the event loop', () => {
  const shape = { layers: 48, topK: 8, experts: 128 };
  const tokens = Array.from({ length: 32768 }, (_, i) => (i * 7919) % 150000);
  const long = { value: npyBase64(stubRoutes(tokens.slice(0, -1), shape), [32767, 48, 8]), field: 'choices[0].routed_experts' };
  const opts = { maxBytes: 64 << 20 };
  let thread: RoutesThread;
  afterEach(() => thread.close());

  /** setImmediate turns the event loop takes while `work` runs: 0 when it held the loop to itself. */
  async function turnsDuring(work: () => Promise<unknown>): Promise<number> {
    let turns = 0;
    let going = true;
    const tick = () => {
      turns++;
      if (going) setImmediate(tick);
    };
    setImmediate(tick);
    await work();
    going = false;
    return turns;
  }

  it(
    'a 32k-token call of 48 layers, top-8: the same record as recordRoutes, while the event loop goes on',
    { timeout: 120_000 },
    async () => {
      thread = new RoutesThread();
      let onThread: RecordedRoutes | undefined;
      expect(await turnsDuring(async () => (onThread = await thread.record(long, 32768, opts)))).toBeGreaterThan(0);
      // the control: checked on the event loop (as before the thread), the loop takes no turn until it is done
      let direct: RecordedRoutes | undefined;
      expect(await turnsDuring(async () => (direct = recordRoutes(long, 32768, opts)))).toBe(0);
      expect(onThread).toEqual(direct);
    },
  );

  it('routes that cannot be recorded come back as RoutesDropped with the reason, field and message', { timeout: 120_000 }, async () => {
    thread = new RoutesThread();
    const short = { value: npyBase64(stubRoutes([1, 2], SHAPE), [2, 3, 2]), field: 'choices[0].routed_experts' };
    const cases: [RawRoutes, number | undefined, RouteOptions][] = [
      [short, 9, opts], // length
      [short, undefined, opts], // untokenized
      [long, 32768, { maxBytes: 1000 }], // too_large
      [{ value: Buffer.alloc(48).toString('base64'), field: 'f' }, 3, opts], // no_shape
    ];
    for (const [raw, n, o] of cases) {
      const want = (() => {
        try {
          recordRoutes(raw, n, o);
        } catch (err) {
          return err as RoutesDropped;
        }
        throw new Error('expected a refusal');
      })();
      const got = await thread.record(raw, n, o).then(
        () => undefined,
        (err: Error) => err,
      );
      expect(got).toBeInstanceOf(RoutesDropped);
      const { reason, field, detail, message } = got as RoutesDropped;
      expect({ reason, field, detail, message }).toEqual({
        reason: want.reason,
        field: want.field,
        detail: want.detail,
        message: want.message,
      });
    }
  });

  it(
    'a thread that dies fails the outputs it held, and the next output starts a new one; after close, none',
    { timeout: 120_000 },
    async () => {
      thread = new RoutesThread();
      const pending = thread.record(long, 32768, opts);
      const worker = (thread as unknown as { worker: { terminate(): Promise<number> } }).worker;
      await worker.terminate();
      await expect(pending).rejects.toThrow(/^the routes thread exited with code 1$/);
      const again = await thread.record({ value: npyBase64(stubRoutes([1, 2, 3], SHAPE), [3, 3, 2]), field: 'f' }, 4, opts);
      expect(again.shape).toEqual([3, 3, 2]);
      await thread.close();
      await expect(thread.record(long, 32768, opts)).rejects.toThrow('the service is closing');
    },
  );
});
