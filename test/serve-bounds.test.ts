/**
 * Retries that mean what they say and bounds on what a client controls (issue 31): an Idempotency-Key reused with
 * another body is 422 and a replay is the first answer byte for byte; a repeated ack is answered 200 on both pools
 * (and FeedClient retries an ack whose answer was lost); request timeouts cut slow senders but not long
 * generations; ids are capped and free of control characters on every path, header and body; group_size is bounded
 * and not an agent's to set; bodies are JSON, valid UTF-8 and nested at most 64 deep before anything is forwarded;
 * a truncated engine answer is reported as one.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createServer as createHttpServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { execFile } from 'node:child_process';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { promisify } from 'node:util';
import { Service, type ServiceOptions } from '../src/serve/service.js';
import { cli } from './helpers/cli.js';
import { installed, pythonFor } from './helpers/python.js';
import { redisAvailable, startRedis, type RedisServer } from './helpers/redis.js';
import { tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const post = (body: unknown, headers: Record<string, string> = {}) => ({
  method: 'POST',
  headers: { 'content-type': 'application/json', ...headers },
  body: typeof body === 'string' ? body : JSON.stringify(body),
});
const chat = (content = 'hi', extra: Record<string, unknown> = {}) => ({ model: 'm', messages: [{ role: 'user', content }], ...extra });
type ErrorBody = { error: { message: string; type: string; code: string | null } };

/** The routes that behave the same on the in-process pool and the Redis pool, run on each. */
function bothPools(name: string, redisUrl: () => string | undefined) {
  describe(`${name}`, { timeout: 60_000 }, () => {
    let stub: StubEngine;
    let svc: Service;
    let base: string;

    beforeAll(async () => {
      stub = await startStubEngine();
      const url = redisUrl();
      const opts: ServiceOptions = {
        packer: { tokenizer: 'qwen3' },
        engineUrl: stub.url,
        dataDir: tempDir('tp-serve-bounds-'),
        port: 0,
        maxGroupSize: 8,
      };
      if (url !== undefined) opts.redis = url;
      svc = await Service.create(opts);
      base = await svc.listen();
    }, 60_000);
    afterAll(async () => {
      await svc?.close();
      await stub?.close();
    });

    it('an Idempotency-Key replay is the first answer byte for byte; the key with another body is 422, not sent', async () => {
      for (const stream of [false, true]) {
        const ep = `idem-${stream}`;
        const h = { 'x-treepack-episode': ep, 'idempotency-key': `k-${stream}` };
        const first = await fetch(
          `${base}/v1/chat/completions`,
          post(chat('hi', { stream, ...(stream && { stream_options: { include_usage: true } }) }), h),
        );
        expect(first.status).toBe(200);
        const text = await first.text();
        const calls = stub.calls;
        const again = await fetch(
          `${base}/v1/chat/completions`,
          post(chat('hi', { stream, ...(stream && { stream_options: { include_usage: true } }) }), h),
        );
        expect(again.status).toBe(200);
        expect(again.headers.get('x-treepack-replayed')).toBe('true');
        expect(await again.text()).toBe(text);
        expect(stub.calls).toBe(calls); // answered from the record, not sent again
        // The engine's id, model and usage are what the first answer carried.
        const chunks = (
          stream
            ? text
                .split('\n\n')
                .filter((l) => l.startsWith('data: {'))
                .map((l) => JSON.parse(l.slice(6)))
            : [JSON.parse(text)]
        ) as Record<string, unknown>[];
        expect(chunks[0].model).toBe('stub');
        expect(chunks.at(-1)!.usage).toMatchObject({ prompt_tokens: expect.any(Number), total_tokens: expect.any(Number) });
        expect(String(chunks[0].id)).toMatch(/^c\d+$/);

        const other = await fetch(`${base}/v1/chat/completions`, post(chat('something else', { stream }), h));
        expect(other.status).toBe(422);
        const { error } = (await other.json()) as ErrorBody;
        expect(error.code).toBe('idempotency_key_reused');
        expect(error.message).toContain(`"k-${stream}"`);
        expect(stub.calls).toBe(calls);
        const recorded = (await (await fetch(`${base}/v1/episodes/${ep}`)).json()) as { calls: unknown[] };
        expect(recorded.calls).toHaveLength(1);
      }
    });

    it('a repeated ack is answered 200 (repeated), before and after its step is done', async () => {
      expect((await fetch(`${base}/v1/chat/completions`, post(chat(), { 'x-treepack-episode': 'acked' }))).status).toBe(200);
      expect((await fetch(`${base}/v1/episodes/acked/finish`, post({ reward: 1 }))).status).toBe(200);
      const res = await fetch(`${base}/v1/batches/next?wait=20`);
      expect(res.status).toBe(200);
      const id = res.headers.get('x-treepack-id')!;
      await res.arrayBuffer();
      const ack = async () => {
        const r = await fetch(`${base}/v1/batches/${id}/ack`, { method: 'POST' });
        expect(r.status).toBe(200);
        return (await r.json()) as { step_done: boolean; repeated: boolean; trainer_version: number };
      };
      const first = await ack();
      expect(first).toMatchObject({ step_done: true, repeated: false });
      expect(await ack()).toMatchObject({ step_done: true, repeated: true, trainer_version: first.trainer_version });
      expect(await ack()).toMatchObject({ repeated: true });
      // an id that never was stays unknown
      expect((await fetch(`${base}/v1/batches/${id.split('.')[0]}.7/ack`, { method: 'POST' })).status).toBe(404);
    });

    it('group_size is bounded by --max-group-size and not settable with an episode key', async () => {
      expect((await fetch(`${base}/v1/chat/completions`, post(chat(), { 'x-treepack-episode': 'big' }))).status).toBe(200);
      const big = await fetch(`${base}/v1/episodes/big/finish`, post({ reward: 1, group_size: 1_000_000_000 }));
      expect(big.status).toBe(400);
      expect(((await big.json()) as ErrorBody).error.message).toMatch(
        /"group_size": expected an integer in 1\.\.8 \(the service's --max-group-size\)/,
      );
      const key = (await (await fetch(`${base}/v1/episodes`, post({ episode_id: 'scoped', group: 'shared-task' }))).json()) as {
        api_key: string;
      };
      const auth = { authorization: `Bearer ${key.api_key}` };
      expect((await fetch(`${base}/v1/chat/completions`, post(chat(), auth))).status).toBe(200);
      const closing = await fetch(`${base}/v1/episodes/scoped/finish`, post({ reward: 1, group_size: 1 }, auth));
      expect(closing.status).toBe(403);
      expect(((await closing.json()) as ErrorBody).error.message).toMatch(/"group_size" is set by the service token/);
      // the key finishes its episode without it; the operator (no token on loopback) may set it
      expect((await fetch(`${base}/v1/episodes/scoped/finish`, post({ reward: 1 }, auth))).status).toBe(200);
      expect((await fetch(`${base}/v1/episodes/big/finish`, post({ reward: 1, group_size: 2 }))).status).toBe(200);
    });
  });
}

bothPools('in process', () => undefined);

const withRedis = redisAvailable('serve-bounds (Redis pool)');
describe.skipIf(!withRedis)('on the Redis pool', () => {
  let redis: RedisServer | undefined;
  beforeAll(async () => {
    redis = await startRedis();
  }, 30_000);
  afterAll(async () => {
    await redis?.stop();
  });
  bothPools('shared pool', () => redis!.url);
});

describe('bounds on what a client sends', { timeout: 60_000 }, () => {
  let stub: StubEngine;
  let svc: Service;
  let base: string;
  let port: number;

  beforeAll(async () => {
    stub = await startStubEngine();
    svc = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: stub.url,
      dataDir: tempDir('tp-serve-bounds-'),
      port: 0,
      requestTimeoutMs: 1500,
    });
    base = await svc.listen();
    port = Number(new URL(base).port);
  }, 60_000);
  afterAll(async () => {
    await svc?.close();
    await stub?.close();
  });

  async function refused(r: Response, status: number, message: RegExp): Promise<void> {
    expect(r.status).toBe(status);
    expect(((await r.json()) as ErrorBody).error.message).toMatch(message);
  }

  it('ids from paths, headers and bodies: capped, no control characters, not blank', async () => {
    const call = (path: string, headers: Record<string, string> = {}) => fetch(`${base}${path}`, post(chat(), headers));
    await refused(
      await call('/v1/chat/completions', { 'x-treepack-episode': 'x'.repeat(10_000) }),
      400,
      /header "x-treepack-episode" .*at most 100 characters, got 10000/,
    );
    await refused(
      await call('/v1/chat/completions', { 'x-treepack-episode': 'ok', 'x-treepack-group': 'g'.repeat(101) }),
      400,
      /header "x-treepack-group" .*at most 100/,
    );
    await refused(
      await call('/v1/chat/completions', { 'x-treepack-episode': 'ok', 'x-treepack-agent': '\t' }),
      400,
      /header "x-treepack-agent" .*blank/,
    );
    await refused(await call('/episodes/a%00b/v1/chat/completions'), 400, /path parameter "episode" "a\\u0000b": .*control characters/);
    await refused(await call('/groups/%0A/episodes/e/v1/chat/completions'), 400, /path parameter "group" .*(blank|control)/);
    await refused(await call('/episodes/%20%20/v1/chat/completions'), 400, /path parameter "episode" .*blank/);
    await refused(await fetch(`${base}/v1/episodes/a%1Fb/finish`, post({ reward: 1 })), 400, /path parameter "id" .*control characters/);
    for (const [id, why] of [
      ['a\u0000b', /control/],
      ['a\nb', /control/],
      [' ', /blank/],
      ['', /blank/],
      ['y'.repeat(101), /at most 100 characters, got 101/],
    ] as const) {
      await refused(await fetch(`${base}/v1/episodes`, post({ episode_id: id })), 400, new RegExp(`field "episode_id" .*${why.source}`));
    }
    await refused(await fetch(`${base}/v1/episodes`, post({ group: 'a\u007fb' })), 400, /field "group" .*control/);
    await refused(await fetch(`${base}/v1/episodes/e/abandon`, post({ group: 'a\rb' })), 400, /field "group" .*control/);
    // ids at the cap and with any printable text pass
    expect((await call(`/episodes/${'z'.repeat(100)}/v1/chat/completions`, { 'x-treepack-group': 'grüße #1' })).status).toBe(200);
  });

  it('bodies: nesting, UTF-8 and content types refused with a 400/415 naming where, before the engine is asked', async () => {
    const calls = stub.calls;
    const deep = `{"model":"m","messages":[{"role":"user","content":"hi","x":${'['.repeat(100_000)}${']'.repeat(100_000)}}]}`;
    const r = await fetch(`${base}/v1/chat/completions`, post(deep, { 'x-treepack-episode': 'deep' }));
    expect(r.status).toBe(400);
    const { error } = (await r.json()) as ErrorBody;
    expect(error.type).toBe('invalid_request_error');
    expect(error.message).toMatch(/^field "messages\[0\]\.x(\[0\])+": nested more than 64 levels deep/);
    // a tool schema 30 levels deep is fine
    let schema: unknown = { type: 'string' };
    for (let i = 0; i < 15; i++) schema = { type: 'object', properties: { p: schema } };
    expect(
      (
        await fetch(
          `${base}/v1/chat/completions`,
          post(chat('ok', { tools: [{ type: 'function', function: { name: 'f', parameters: schema } }] }), {
            'x-treepack-episode': 'schema',
          }),
        )
      ).status,
    ).toBe(200);

    const bad = Buffer.concat([
      Buffer.from('{"model":"m","messages":[{"role":"user","content":"h'),
      Buffer.from([0xc3, 0x28]),
      Buffer.from('i"}]}'),
    ]);
    const u = await fetch(`${base}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-treepack-episode': 'utf8' },
      body: bad,
    });
    await refused(u, 400, /invalid UTF-8 at byte 52/);
    expect((await fetch(`${base}/v1/episodes/utf8`)).status).toBe(404); // nothing recorded
    await refused(
      await fetch(`${base}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'text/plain', 'x-treepack-episode': 'tp' },
        body: JSON.stringify(chat()),
      }),
      415,
      /text\/plain/,
    );
    expect(stub.calls).toBe(calls + 1); // only the good call reached the engine
    // JSON under a +json media type, and a charset parameter, are read
    expect(
      (
        await fetch(`${base}/v1/chat/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json; charset=utf-8', 'x-treepack-episode': 'cs' },
          body: JSON.stringify(chat()),
        })
      ).status,
    ).toBe(200);
  });

  /** A raw socket that sends `head`, then one byte of `rest` every `everyMs`; resolves when the server closes it. */
  function dribble(head: string, rest: string, everyMs: number): { closed: Promise<string>; socket: Socket } {
    const socket = connect(port, '127.0.0.1');
    let got = '';
    let i = 0;
    let timer: NodeJS.Timeout | undefined;
    socket.on('connect', () => {
      socket.write(head);
      timer = setInterval(() => {
        if (i < rest.length && socket.writable) socket.write(rest[i++]);
      }, everyMs);
    });
    socket.on('data', (d) => (got += d.toString()));
    socket.on('error', () => {});
    const closed = new Promise<string>((resolve) =>
      socket.on('close', () => {
        clearInterval(timer);
        resolve(got);
      }),
    );
    return { closed, socket };
  }

  it('--request-timeout: slow headers and slow bodies get 408 and their sockets closed; a long generation is not cut', async () => {
    const calls = stub.calls;
    const body = JSON.stringify(chat());
    const head = `POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-treepack-episode: slow\r\ncontent-length: ${body.length}\r\n\r\n`;
    const slowHeaders = dribble('POST /v1/chat/completions HTTP/1.1\r\n', 'x-treepack-episode: slow\r\n'.repeat(100), 200);
    const slowBody = dribble(head, body, 200);
    // 40 s: far beyond the 1.5 s timeout; the sender would take 200 ms x its bytes, minutes
    const bound = (p: Promise<string>) =>
      Promise.race([p, new Promise<string>((_, rej) => setTimeout(() => rej(new Error('socket still open 40 s later')), 40_000))]);
    expect(await bound(slowHeaders.closed)).toMatch(/^HTTP\/1\.1 408/);
    expect(await bound(slowBody.closed)).toMatch(/^HTTP\/1\.1 408/);
    expect(stub.calls).toBe(calls); // neither reached the engine
    // An engine slower than the request timeout: the request was received whole, so the answer is waited for.
    stub.delayMs = 3000;
    try {
      const r = await fetch(`${base}/v1/chat/completions`, post(chat(), { 'x-treepack-episode': 'long-generation' }));
      expect(r.status).toBe(200);
    } finally {
      stub.delayMs = undefined;
    }
  });

  it('a truncated engine answer is reported as truncated (502), not "unreachable: aborted"', async () => {
    const cut: Server = createHttpServer((req, res) => {
      req.resume();
      req.on('end', () => {
        res.writeHead(200, { 'content-type': 'application/json', 'content-length': 1000 });
        res.write('{"id":"c0","choices":[');
        setTimeout(() => res.socket?.destroy(), 50);
      });
    });
    await new Promise<void>((r) => cut.listen(0, '127.0.0.1', r));
    const other = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: `http://127.0.0.1:${(cut.address() as { port: number }).port}/v1`,
      dataDir: tempDir('tp-serve-cut-'),
      port: 0,
    });
    try {
      const url = await other.listen();
      const r = await fetch(`${url}/v1/chat/completions`, post(chat(), { 'x-treepack-episode': 'cut' }));
      expect(r.status).toBe(502);
      const { error } = (await r.json()) as ErrorBody;
      expect(error.message).toMatch(/closed the connection after 22 bytes of its answer of the 1000 it announced .*truncated/);
      expect(error.message).not.toMatch(/unreachable/);
    } finally {
      await other.close();
      await new Promise<void>((r) => cut.close(() => r()));
    }
  });

  it('treepack serve flags: --request-timeout and --max-group-size', () => {
    const help = cli(['serve', '--help']);
    expect(help.stdout).toMatch(/--request-timeout S .*\n.*\[default: 60\]/);
    expect(help.stdout).toMatch(/--max-group-size N[\s\S]*\[default: 1024\]/);
    const base = ['serve', '--engine', 'http://127.0.0.1:1/v1', '--data', tempDir('tp-serve-flags-'), '--tokenizer', 'qwen3'];
    const r = cli([...base, '--group-size', '16', '--max-group-size', '8']);
    expect(r.code).toBe(2);
    expect(r.stderr).toMatch(/Expected an integer <= maxGroupSize \(8\) for --group-size but received 16/);
    expect(cli([...base, '--request-timeout', '0']).stderr).toMatch(/--request-timeout/);
  });
});

const py = pythonFor('serve-bounds (FeedClient)', 'numpy');
describe.skipIf(py.skipReason !== '')('FeedClient.ack after a lost answer', { timeout: 120_000 }, () => {
  it('retries, and the repeated ack does not raise', async () => {
    const stub = await startStubEngine();
    const svc = await Service.create({ packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, dataDir: tempDir('tp-serve-ackpy-'), port: 0 });
    const base = await svc.listen();
    // A proxy that delivers the first ack to the service, then drops the connection before its answer.
    let dropped = 0;
    const forward = async (req: IncomingMessage, res: ServerResponse) => {
      const r = await fetch(`${base}${req.url}`, {
        method: req.method,
        headers: { 'content-type': 'application/json' },
        body: req.method === 'POST' ? '{}' : undefined,
      });
      const text = await r.text();
      if (req.url!.endsWith('/ack') && dropped++ === 0) return res.socket!.destroy();
      res.writeHead(r.status, { 'content-type': 'application/json' });
      res.end(text);
    };
    const proxy = createHttpServer((req, res) => void forward(req, res));
    await new Promise<void>((r) => proxy.listen(0, '127.0.0.1', r));
    try {
      expect((await fetch(`${base}/v1/chat/completions`, post(chat(), { 'x-treepack-episode': 'py' }))).status).toBe(200);
      expect((await fetch(`${base}/v1/episodes/py/finish`, post({ reward: 1 }))).status).toBe(200);
      const res = await fetch(`${base}/v1/batches/next?wait=20`);
      const id = res.headers.get('x-treepack-id')!;
      await res.arrayBuffer();
      const url = `http://127.0.0.1:${(proxy.address() as { port: number }).port}`;
      // asynchronously: the service and the proxy answer from this process meanwhile
      const env: NodeJS.ProcessEnv = { ...process.env, PYTHONDONTWRITEBYTECODE: '1' };
      delete env.PYTHONPATH;
      const code = 'import json, sys\nfrom treepack.client import FeedClient\nprint(json.dumps(FeedClient(sys.argv[1]).ack(sys.argv[2])))';
      const r = await promisify(execFile)(installed().python!, ['-c', code, url, id], { cwd: tmpdir(), env, timeout: 60_000 });
      expect(r.stderr).not.toMatch(/Traceback/);
      expect(JSON.parse(r.stdout.trim())).toMatchObject({ id, step_done: true, repeated: true });
      expect(dropped).toBe(2);
    } finally {
      await new Promise<void>((r) => proxy.close(() => r()));
      await svc.close();
      await stub.close();
    }
  });
});
