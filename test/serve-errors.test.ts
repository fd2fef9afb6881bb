/**
 * Bad input and misbehaving engines: each gets a clear HTTP error naming the field, and the service keeps
 * serving (a good call succeeds after every bad one). Also: authentication, body and rate limits,
 * backpressure, /healthz and /metrics.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { join } from 'node:path';
import { resolveServiceOptions, Service, sharedConfig } from '../src/serve/service.js';
import { cli } from './helpers/cli.js';
import { freePort, tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const json = (body: unknown, headers: Record<string, string> = {}) => ({
  method: 'POST',
  headers: { 'content-type': 'application/json', ...headers },
  body: typeof body === 'string' ? body : JSON.stringify(body),
});
const chat = (content = 'hi') => ({ model: 'm', messages: [{ role: 'user', content }] });
type ErrorBody = { error: { message: string; type?: string; code?: string | null } };

describe('service errors', { timeout: 30_000 }, () => {
  let stub: StubEngine;
  let svc: Service;
  let base: string;

  beforeAll(async () => {
    stub = await startStubEngine();
    svc = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: stub.url,
      dataDir: tempDir('tp-serve-err-'),
      port: 0,
      engineTimeoutMs: 500,
      bodyLimit: 4096,
    });
    base = await svc.listen();
  });
  afterAll(async () => {
    await svc?.close();
    await stub?.close();
  });

  async function good(): Promise<void> {
    stub.mode = 'ok';
    const r = await fetch(`${base}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': `good-${Math.random()}` }));
    expect(r.status).toBe(200);
    expect((await fetch(`${base}/healthz`)).status).toBe(200);
  }

  const cases: [string, () => Promise<Response>, number, RegExp][] = [
    ['malformed JSON', () => fetch(`${base}/v1/chat/completions`, json('{"messages": [', { 'x-treepack-episode': 'e1' })), 400, /JSON/i],
    ['no messages', () => fetch(`${base}/v1/chat/completions`, json({ model: 'm' }, { 'x-treepack-episode': 'e1' })), 400, /"messages"/],
    [
      'message without role',
      () => fetch(`${base}/v1/chat/completions`, json({ messages: [{ content: 'x' }] }, { 'x-treepack-episode': 'e1' })),
      400,
      /"messages\[0\]\.role": expected a string/,
    ],
    [
      'stream not a boolean',
      () => fetch(`${base}/v1/chat/completions`, json({ ...chat(), stream: 'yes' }, { 'x-treepack-episode': 'e1' })),
      400,
      /"stream": expected true or false/,
    ],
    ['unknown route', () => fetch(`${base}/v1/nope`, json({})), 404, /no route POST \/v1\/nope/],
    [
      'episode id too long',
      () => fetch(`${base}/episodes/${'x'.repeat(200)}/v1/chat/completions`, json(chat())),
      414,
      /longer than 100 characters/,
    ],
    ['URL not decodable', () => fetch(`${base}/v1/episodes/%zz/finish`, json({ reward: 1 })), 400, /percent-encoding/],
    [
      'n out of range',
      () => fetch(`${base}/v1/chat/completions`, json({ ...chat(), n: 0 }, { 'x-treepack-episode': 'e1' })),
      400,
      /"n": expected an integer in 1\.\.128/,
    ],
    ['no episode', () => fetch(`${base}/v1/chat/completions`, json(chat())), 400, /no episode/],
    [
      'completion without a prompt string',
      () => fetch(`${base}/v1/completions`, json({ prompt: ['a', 'b'] }, { 'x-treepack-episode': 'e1' })),
      400,
      /"prompt"/,
    ],
    [
      'oversized body',
      () => fetch(`${base}/v1/chat/completions`, json(chat('x'.repeat(10_000)), { 'x-treepack-episode': 'e1' })),
      413,
      /larger than 4096 bytes .*--body-limit/,
    ],
    ['unknown episode', () => fetch(`${base}/v1/episodes/nope`), 404, /unknown episode "nope"/],
    ['finish without reward', () => fetch(`${base}/v1/episodes/nope/finish`, json({ metadata: {} })), 400, /"reward"/],
    [
      'bad policy version',
      () => fetch(`${base}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'e1', 'x-treepack-policy-version': '-1' })),
      400,
      /x-treepack-policy-version/,
    ],
    ['rank out of range', () => fetch(`${base}/v1/batches/next?rank=3`), 400, /"rank"/],
    ['dp mismatch', () => fetch(`${base}/v1/batches/next?rank=0&dp=4`), 400, /"dp"/],
    ['unknown micro-batch', () => fetch(`${base}/v1/batches/9.9/ack`, { method: 'POST' }), 404, /unknown micro-batch/],
    [
      'slime record without assistant answer',
      () =>
        fetch(
          `${base}/buffer/write`,
          json({
            uid: 'u',
            instance_id: 'i',
            messages: [
              { role: 'user', content: 'q' },
              { role: 'user', content: 'q' },
            ],
            reward: 1,
            extra_info: {},
          }),
        ),
      400,
      /"messages\[1\].role"/,
    ],
    ['start_rollout without group size', () => fetch(`${base}/start_rollout`, json({ task_type: 'math' })), 400, /num_repeat_per_sample/],
  ];
  for (const [name, send, status, message] of cases) {
    it(`${name}: ${status}, and the service keeps serving`, async () => {
      const r = await send();
      expect(r.status).toBe(status);
      const { error } = (await r.json()) as ErrorBody;
      expect(error.message).toMatch(message);
      expect(error.type).toBe('invalid_request_error'); // the service's shape, never Fastify's
      await good();
    });
  }

  it('finish twice, and a call after finish: 409', async () => {
    stub.mode = 'ok';
    expect((await fetch(`${base}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'twice' }))).status).toBe(200);
    expect((await fetch(`${base}/v1/episodes/twice/finish`, json({ reward: 1 }))).status).toBe(200);
    // a retry with the same body is answered as the first; another reward is refused
    expect((await fetch(`${base}/v1/episodes/twice/finish`, json({ reward: 1 }))).status).toBe(200);
    const again = await fetch(`${base}/v1/episodes/twice/finish`, json({ reward: 0 }));
    expect(again.status).toBe(409);
    expect(((await again.json()) as ErrorBody).error.message).toMatch(/already finished/);
    const late = await fetch(`${base}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'twice' }));
    expect(late.status).toBe(409);
    await good();
  });

  const engineCases: [StubEngine['mode'], number, RegExp][] = [
    ['garbage', 502, /expected JSON/],
    ['no-choices', 502, /"choices"/],
    ['bad-logprobs', 502, /"choices\[0\]\.logprobs\.content\[0\]\.logprob"/],
    ['hang', 504, /did not answer within 500 ms/],
    ['error-500', 500, /engine overloaded/],
  ];
  for (const [mode, status, message] of engineCases) {
    it(`engine ${mode}: ${status}, nothing recorded, and the service keeps serving`, async () => {
      stub.mode = mode;
      const ep = `engine-${mode}`;
      const r = await fetch(`${base}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': ep }));
      expect(r.status).toBe(status);
      const { error } = (await r.json()) as ErrorBody;
      expect(error.message).toMatch(message);
      if (status !== 500) expect(error.type).toBe('engine_error'); // the engine's own 500 goes back as it sent it
      expect((await fetch(`${base}/v1/episodes/${ep}`)).status).toBe(404);
      await good();
    });
  }

  it('engine garbage in a stream: an error event, no [DONE], nothing recorded', async () => {
    stub.mode = 'garbage';
    const r = await fetch(`${base}/v1/chat/completions`, json({ ...chat(), stream: true }, { 'x-treepack-episode': 'stream-garbage' }));
    const text = await r.text();
    expect(text).toMatch(/without data: \[DONE\]|not JSON/);
    expect(text).not.toMatch(/\[DONE\]\n/);
    expect((await fetch(`${base}/v1/episodes/stream-garbage`)).status).toBe(404);
    await good();
  });

  it('engine stalling mid-stream: an error event naming the timeout, no [DONE], nothing recorded', async () => {
    stub.mode = 'stall-stream';
    const r = await fetch(`${base}/v1/chat/completions`, json({ ...chat(), stream: true }, { 'x-treepack-episode': 'stream-stall' }));
    const text = await r.text();
    expect(text).toMatch(/"message":"the engine's stream did not end within 500 ms \(--engine-timeout\)","type":"engine_error"/);
    expect(text).not.toMatch(/\[DONE\]/);
    expect((await fetch(`${base}/v1/episodes/stream-stall`)).status).toBe(404);
    expect(await (await fetch(`${base}/metrics`)).text()).toMatch(/treepack_calls_total\{endpoint="chat",outcome="engine_timeout"\} [1-9]/);
    await good();
  });

  it('engine down: 502 naming the engine', async () => {
    const port = await new Promise<number>((res) => {
      const s: Server = createServer();
      s.listen(0, '127.0.0.1', () => {
        const p = (s.address() as { port: number }).port;
        s.close(() => res(p));
      });
    });
    const down = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: `http://127.0.0.1:${port}/v1`,
      dataDir: tempDir('tp-serve-down-'),
      port: 0,
    });
    const url = await down.listen();
    const r = await fetch(`${url}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'x' }));
    expect(r.status).toBe(502);
    expect(((await r.json()) as ErrorBody).error).toMatchObject({ message: expect.stringMatching(/unreachable/), type: 'engine_error' });
    expect((await fetch(`${url}/healthz`)).status).toBe(200);
    await down.close();
  });

  it('start-up failures: a port in use and an unusable --data are one line naming the cause, exit 1', async () => {
    const data = tempDir('tp-serve-start-');
    writeFileSync(join(data, 'file'), '');
    const port = String(new URL(base).port);
    const args = ['serve', '--engine', stub.url, '--tokenizer', 'qwen3'];
    const inUse = cli([...args, '--data', join(data, 'd'), '--port', port]);
    expect(inUse.code).toBe(1);
    expect(inUse.stderr.trim()).toMatch(
      new RegExp(`^treepack serve: port ${port} on 127\\.0\\.0\\.1 is in use \\(another service\\?\\): choose another with --port$`),
    );
    const notDir = cli([...args, '--data', join(data, 'file', 'sub'), '--port', String(await freePort())]);
    expect(notDir.code).toBe(1);
    expect(notDir.stderr.trim()).toMatch(/^treepack serve: \S*\/file\/sub: cannot create the log directory: ENOTDIR: not a directory$/);
  });

  it('library options of the shared pool: a wrong type names the option', () => {
    const base = { engineUrl: stub.url, dataDir: '/tmp/x', redis: 'redis://127.0.0.1:6379' };
    expect(() => resolveServiceOptions({ ...base, redisAllowWeakDurability: 'yes' as never })).toThrow(
      /for redisAllowWeakDurability but received "yes"/,
    );
    expect(() => resolveServiceOptions({ ...base, warn: 'stderr' as never })).toThrow(/for warn but received "stderr"/);
    expect(resolveServiceOptions({ ...base, redisAllowWeakDurability: true }).redisAllowWeakDurability).toBe(true);
    // Step plans need their order kept across a re-handout, which the Redis feed does not do.
    expect(() => resolveServiceOptions({ ...base, packer: { budget: { maxTokens: 64, prefixCacheTokens: 256 } } })).toThrow(
      /step plans .* not through a shared Redis pool/,
    );
    expect(() =>
      resolveServiceOptions({ ...base, redis: undefined, packer: { budget: { maxTokens: 64, prefixCacheTokens: 256 } } }),
    ).not.toThrow();
    // The feed hands a micro-batch to one rank: a context-parallel plan (docs/design.md §11) is not served.
    expect(() =>
      resolveServiceOptions({ ...base, redis: undefined, dp: 2, packer: { budget: { maxTokens: 64, prefixCacheTokens: 256, cp: 2 } } }),
    ).toThrow(/context-parallel group for packer\.budget\.cp/);
  });

  it('timelines compare by token unless told, in the library as in `treepack serve`', () => {
    const base = { engineUrl: stub.url, dataDir: '/tmp/x' };
    expect(resolveServiceOptions(base).packer.merge).toEqual({ timelineCompareLevel: 'token' });
    expect(resolveServiceOptions({ ...base, packer: { merge: { timelineCompareLevel: 'text' } } }).packer.merge).toEqual({
      timelineCompareLevel: 'text',
    });
    expect(resolveServiceOptions({ ...base, packer: { merge: false } }).packer.merge).toBe(false);
    expect(() => resolveServiceOptions({ ...base, packer: 'x' as never })).toThrow(/for packer but received "x"/);
    // The options the CLI spelled out before the library had this default: a library service and a CLI one
    // agree on a shared pool.
    const cli = { backend: 'auto', merge: { timelineCompareLevel: 'token' }, advantages: 'grpo' } as const;
    expect(sharedConfig(resolveServiceOptions(base))).toEqual(sharedConfig(resolveServiceOptions({ ...base, packer: cli })));
  });

  it('a non-loopback bind needs a token; the token is then required', async () => {
    expect(() => resolveServiceOptions({ engineUrl: stub.url, dataDir: '/tmp/x', host: '0.0.0.0' })).toThrow(/bearer token/);
    stub.mode = 'ok';
    const sec = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: stub.url,
      dataDir: tempDir('tp-serve-auth-'),
      port: 0,
      host: '127.0.0.1',
      token: 's3cret',
    });
    const url = await sec.listen();
    expect((await fetch(`${url}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'a' }))).status).toBe(401);
    expect((await fetch(`${url}/v1/batches/next`, { headers: { authorization: 'Bearer wrong' } })).status).toBe(401);
    expect((await fetch(`${url}/healthz`)).status).toBe(200);
    expect(
      (await fetch(`${url}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'a', authorization: 'Bearer s3cret' }))).status,
    ).toBe(200);
    // A scoped key issued by an authenticated call opens its episode's calls, and nothing else.
    const key = (
      (await (await fetch(`${url}/v1/episodes`, json({ episode_id: 'k' }, { authorization: 'Bearer s3cret' }))).json()) as {
        api_key: string;
      }
    ).api_key;
    expect((await fetch(`${url}/v1/chat/completions`, json(chat(), { authorization: `Bearer ${key}` }))).status).toBe(200);
    expect((await fetch(`${url}/v1/batches/next`, { headers: { authorization: `Bearer ${key}` } })).status).toBe(403);
    await sec.close();
  });

  it('backpressure: 429 with Retry-After once the pool is full, and rate limits', async () => {
    stub.mode = 'ok';
    const full = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: stub.url,
      dataDir: tempDir('tp-serve-full-'),
      port: 0,
      maxPoolBytes: 1,
    });
    const url = await full.listen();
    expect((await fetch(`${url}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'p' }))).status).toBe(200);
    const r = await fetch(`${url}/v1/chat/completions`, json(chat(), { 'x-treepack-episode': 'p' }));
    expect(r.status).toBe(429);
    expect(r.headers.get('retry-after')).toBe('1');
    expect(((await r.json()) as ErrorBody).error.message).toMatch(/pool is full/);
    // Finishing still works (it frees the pool once the trainer consumes the group).
    expect((await fetch(`${url}/v1/episodes/p/finish`, json({ reward: 0 }))).status).toBe(200);
    await full.close();

    const limited = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: stub.url,
      dataDir: tempDir('tp-serve-rate-'),
      port: 0,
      rateLimit: 3,
    });
    const lurl = await limited.listen();
    const codes = [];
    for (let i = 0; i < 5; i++) codes.push((await fetch(`${lurl}/v1/feed`)).status);
    expect(codes).toEqual([200, 200, 200, 429, 429]);
    // Retry-After is the window's time left (the SDKs wait that long), and health probes are not limited.
    const over = await fetch(`${lurl}/v1/feed`);
    expect(Number(over.headers.get('retry-after'))).toBeGreaterThan(50);
    expect(((await over.json()) as ErrorBody).error.type).toBe('rate_limit_error');
    for (let i = 0; i < 5; i++) expect((await fetch(`${lurl}/healthz`)).status).toBe(200);
    await limited.close();
  });

  it('/metrics: Prometheus text with calls, episodes, micro-batches, queue depth and latency', async () => {
    const text = await (await fetch(`${base}/metrics`)).text();
    for (const name of [
      'treepack_calls_total{endpoint="chat",outcome="recorded"}',
      'treepack_episodes_finished_total',
      'treepack_open_episodes',
      'treepack_pool_bytes',
      'treepack_gateway_seconds_bucket',
      'treepack_rejected_total',
    ]) {
      expect(text).toContain(name);
    }
  });

  it("/metrics: the event loop's delay since the last scrape, and the log's durable writes", async () => {
    expect(
      (await fetch(`${base}/v1/episodes`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' })).status,
    ).toBe(200); // a logged event
    // A scrape resets the loop-delay gauges; the stall begins at once, before the loop's next tick (node's
    // monitorEventLoopDelay lost such a stall: it forgets its last tick when reset).
    await svc.metrics.registry.metrics();
    const until = performance.now() + 200;
    while (performance.now() < until); // a 200 ms stall of the service's loop (it runs in this process)
    const max = (t: string) => Number(/^treepack_event_loop_delay_seconds\{quantile="max"\} (\S+)$/m.exec(t)![1]);
    const stalled = await (await fetch(`${base}/metrics`)).text();
    expect(max(stalled)).toBeGreaterThanOrEqual(0.15);
    expect(max(await (await fetch(`${base}/metrics`)).text())).toBeLessThan(max(stalled)); // reset by the scrape
    expect(Number(/^treepack_log_write_seconds_count (\S+)$/m.exec(stalled)![1])).toBeGreaterThan(0);
    expect(stalled).toContain('# TYPE treepack_gc_pause_seconds histogram');
  });
});

describe('treepack serve flags', () => {
  it('--help, and flag errors with exit code 2 before anything starts', () => {
    const help = cli(['serve', '--help']);
    expect(help.code).toBe(0);
    expect(help.stdout).toMatch(/--engine URL/);
    const base = ['serve', '--engine', 'http://127.0.0.1:1/v1', '--data', '/tmp/x', '--tokenizer', 'qwen3'];
    const cases: [string[], RegExp][] = [
      [['serve', '--data', '/tmp/x'], /--engine URL and --data DIR are required/],
      [['serve', '--engine', 'http://127.0.0.1:1/v1', '--data', '/tmp/x'], /--tokenizer DIR\|NAME is required/],
      [['serve', '--engine', 'localhost:8000', '--data', '/tmp/x', '--tokenizer', 'qwen3'], /for --engine but received "localhost:8000"/],
      [[...base, '--host', '0.0.0.0'], /bound to 0\.0\.0\.0, not loopback, needs a bearer token .*--token T/],
      [[...base, '--dp', '2'], /--dp needs --max-tokens/],
      [[...base, '--policy', 'async', '--window', '3'], /--window applies to --policy windowed-fifo/],
      [[...base, '--pad-multiple', '8'], /--pad-multiple needs --max-tokens T/],
      [[...base, '--max-tokens', '64', '--dp', '2', '--pad-multiple', 'x'], /for --pad-multiple but received "x"/],
      [[...base, '--bogus', '1'], /Unknown option '--bogus'/],
      [[...base, '--redis-allow-weak-durability'], /--redis-allow-weak-durability applies to the shared pool: it needs --redis URL/],
      [
        [...base, '--redis', 'redis://127.0.0.1:1', '--max-tokens', '64', '--prefix-reuse', '100'],
        /step plans .*--prefix-reuse.* not through a shared Redis pool/,
      ],
    ];
    // Every flag's bad value: exit 2, the flag named.
    const bad: [string, string, RegExp?][] = [
      ['--port', 'x'],
      ['--engine-timeout', '0'],
      ['--group-size', '-1'],
      ['--policy', 'lifo'],
      ['--window', '0'],
      ['--groups-per-step', '1.5'],
      ['--lease', 'soon'],
      ['--max-pool-bytes', '0'],
      ['--body-limit', '1e9x'],
      ['--rate-limit', '-5'],
      ['--compact-bytes', '0'],
      ['--idle-timeout', '-1'],
      ['--idle-timeout', 'never'],
      ['--redis', '127.0.0.1:6379', /Expected a Redis URL, e.g. redis:\/\/127.0.0.1:6379 for --redis/],
      ['--backend', 'gpu'],
      ['--max-tokens', '0'],
      ['--dp', 'two'],
      ['--advantages', 'ppo'],
      ['--timeline-compare-level', 'char'],
    ];
    for (const [flag, value, message] of bad)
      cases.push([[...base, `${flag}=${value}`], message ?? new RegExp(`for ${flag} but received`)]);
    for (const [args, message] of cases) {
      const r = cli(args);
      expect(r.code, args.join(' ')).toBe(2);
      expect(r.stderr).toMatch(message);
    }
  });
});
