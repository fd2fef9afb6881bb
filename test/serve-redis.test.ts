/**
 * The shared pool on a real Redis (`--redis`): two services (gateways) on one Redis, episodes of one group
 * arriving through both, two trainer ranks pulling from either; a trainer killed before acknowledging gets its
 * micro-batch handed out again after the lease, through the other service; Redis killed -9 and restarted from
 * its append-only file loses nothing acknowledged and duplicates nothing acknowledged; a gateway that died between
 * its log and Redis ships on restart, once; slime's reads take whole groups from the shared pool. The shared
 * state stays small (the `groups` stream is trimmed as groups are taken, and a restarted service carries on
 * from it); a Redis that may lose acknowledged writes is refused; a service killed -9 while it forms a step holds
 * the others up for the form lock's short lease only. A scoped key minted by one gateway opens its episode on all.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { createHash } from 'node:crypto';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { parseSafetensors } from '../src/io/safetensors.js';
import { DEFAULT_WINDOW_TOKENS } from '../src/packer/options.js';
import { Service, type ServiceOptions } from '../src/serve/service.js';
import { cli } from './helpers/cli.js';
import { redisAvailable, startRedis, type RedisServer } from './helpers/redis.js';
import { slimeRecord as record, startServeProcess, tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const post = (url: string, body: unknown, headers: Record<string, string> = {}) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) });

interface Entry {
  id: string;
  groups: string[];
  rank: number;
  feed_step: number;
  trainer_version: number;
}

interface Got {
  entry: Entry;
  bytes: Buffer;
  seqIds: string[];
}

async function pull(base: string, rank: number, wait = 0): Promise<Got | undefined> {
  const res = await fetch(`${base}/v1/batches/next?rank=${rank}&wait=${wait}`);
  if (res.status === 204) return undefined;
  expect(res.status, await res.clone().text()).toBe(200);
  const bytes = Buffer.from(await res.arrayBuffer());
  const entry = JSON.parse(res.headers.get('x-treepack-entry')!) as Entry;
  return { entry, bytes, seqIds: JSON.parse(parseSafetensors(new Uint8Array(bytes)).metadata.sequence_ids) as string[] };
}

const episodeOf = (seq: string) => seq.split('/')[0];

const run = redisAvailable('serve-redis') ? describe : describe.skip;

run('shared pool on Redis Streams', { timeout: 60_000 }, () => {
  let redis: RedisServer;
  let stub: StubEngine;
  const open: Service[] = [];
  beforeAll(async () => {
    stub = await startStubEngine();
  });
  afterEach(async () => {
    for (const s of open.splice(0)) await s.close();
    await redis?.stop();
  });
  afterAll(async () => {
    await stub?.close();
  });

  /** Two services (gateways and feeds) on one fresh Redis. */
  async function gateways(opts: Partial<ServiceOptions>): Promise<[string, string, Service, Service]> {
    redis = await startRedis();
    const make = async () => {
      const svc = await Service.create({
        engineUrl: stub.url,
        dataDir: tempDir('tp-redis-gw-'),
        port: 0,
        redis: redis.url,
        ...opts,
        packer: { tokenizer: 'qwen3', ...opts.packer },
      });
      open.push(svc);
      return svc;
    };
    const a = await make();
    const b = await make();
    return [await a.listen(), await b.listen(), a, b];
  }

  it('two gateways, groups split across them, two trainer ranks pulling from either: every episode once', async () => {
    const [A, B] = await gateways({ groupSize: 2, dp: 2, groupsPerStep: 2, packer: { budget: { maxTokens: 96, dp: 2 } } });
    const expected: string[] = [];
    // Groups 0-2: agents call through the gateways, episode 0 through A and episode 1 through B.
    for (let g = 0; g < 3; g++) {
      for (const [k, base] of [A, B].entries()) {
        const ep = `c${g}-e${k}`;
        const headers = { 'x-treepack-episode': ep, 'x-treepack-group': `c${g}` };
        const r = await post(`${base}/v1/chat/completions`, { model: 'm', messages: [{ role: 'user', content: `task ${g}` }] }, headers);
        expect(r.status).toBe(200);
        const f = (await (await post(`${base}/v1/episodes/${ep}/finish`, { reward: k })).json()) as {
          group_episodes: number;
          group_finished: boolean;
        };
        // The group's episodes are counted in Redis, whichever gateway recorded them.
        expect(f).toMatchObject({ group_episodes: k + 1, group_finished: k === 1 });
        expect((await fetch(`${base}/v1/episodes/${ep}/records`)).status).toBe(410); // shipped
        expected.push(ep);
      }
    }
    // Groups 3-5: producers write slime records, episode 0 to B and episode 1 to A.
    for (let g = 3; g < 6; g++) {
      for (const [k, base] of [B, A].entries()) {
        expect((await post(`${base}/buffer/write`, record(g, k, k))).status).toBe(200);
        expected.push(`g${g}-e${k}`);
      }
    }
    // Two trainer ranks, rank 0 pulling from A and rank 1 from B, acknowledging after each step.
    const got: Got[] = [];
    const trainer = async (base: string, rank: number) => {
      for (let idle = 0; idle < 3;) {
        const mb = await pull(base, rank, 1);
        if (!mb) {
          idle++;
          continue;
        }
        expect(mb.entry.rank).toBe(rank);
        got.push(mb);
        expect((await post(`${base}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);
      }
    };
    await Promise.all([trainer(A, 0), trainer(B, 1)]);
    const ids = got.map((g) => g.entry.id);
    expect(new Set(ids).size).toBe(ids.length);
    // Every episode is trained exactly once (a chat episode's sequences are named after it), in its group's micro-batches.
    const trained = got.flatMap((g) => [...new Set(g.seqIds.map(episodeOf))]);
    expect(trained.sort()).toEqual(expected.sort());
    for (const g of got) for (const s of g.seqIds) expect(g.entry.groups).toContain(episodeOf(s).replace(/-e\d$/, ''));
    // Three steps of two groups each; both services see the trainer at version 3.
    expect(new Set(got.map((g) => g.entry.feed_step))).toEqual(new Set([0, 1, 2]));
    for (const base of [A, B])
      expect(((await (await fetch(`${base}/v1/feed`)).json()) as { trainer_version: number }).trainer_version).toBe(3);
  });

  it('abandoned episodes and groups, and the idle timeout measured over both gateways: the feed never stalls past it', async () => {
    const [A, B] = await gateways({ groupSize: 2, idleTimeoutMs: 1500 });
    const call = (base: string, group: string, ep: string) =>
      post(`${base}/groups/${group}/episodes/${ep}/v1/chat/completions`, { messages: [{ role: 'user', content: ep }] });
    // Head group H: h1 finishes through A, h2 never calls. Group X: x2's agent finishes without a call (abandoned).
    expect((await call(A, 'H', 'h1')).status).toBe(200);
    expect((await post(`${A}/v1/episodes/h1/finish`, { reward: 1 })).status).toBe(200);
    expect((await call(A, 'X', 'x1')).status).toBe(200);
    expect((await post(`${A}/v1/episodes/x1/finish`, { reward: 1 })).status).toBe(200);
    expect((await post(`${B}/v1/episodes`, { episode_id: 'x2', group: 'X' })).status).toBe(200);
    expect(await (await post(`${B}/v1/episodes/x2/finish`, { reward: 0 })).json()).toMatchObject({ abandoned: true, group_episodes: 2 });
    // Group S: s1 finished through A; s2 keeps calling through B past A's idle timeout, so A must not close S.
    expect((await call(A, 'S', 's1')).status).toBe(200);
    expect((await post(`${A}/v1/episodes/s1/finish`, { reward: 1 })).status).toBe(200);
    for (const g of 'CDE') {
      for (const e of [1, 2]) {
        expect((await call(B, g, `${g}${e}`)).status).toBe(200);
        expect((await post(`${B}/v1/episodes/${g}${e}/finish`, { reward: e })).status).toBe(200);
      }
    }
    const t0 = Date.now();
    for (let k = 0; Date.now() - t0 < 3000; k++) {
      expect((await call(B, 'S', 's2')).status).toBe(200);
      await new Promise((r) => setTimeout(r, 300));
    }
    expect((await post(`${B}/v1/episodes/s2/finish`, { reward: 0 })).status).toBe(200);
    const trained: Record<string, string[]> = {};
    for (let idle = 0; idle < 3;) {
      const mb = await pull(idle % 2 ? A : B, 0, 1);
      if (!mb) {
        idle++;
        continue;
      }
      trained[mb.entry.groups[0]] = [...new Set(mb.seqIds.map(episodeOf))].sort();
      expect((await post(`${A}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);
    }
    // H closed by the idle timeout with h1, X with x1; S whole: both its episodes, s2's many calls included.
    expect(trained).toEqual({ H: ['h1'], X: ['x1'], S: ['s1', 's2'], C: ['C1', 'C2'], D: ['D1', 'D2'], E: ['E1', 'E2'] });
    expect(Date.now() - t0).toBeLessThan(15_000);
    // An explicit abandonment of a consumed group is refused; of an unknown one, 404.
    expect((await post(`${A}/v1/groups/H/abandon`, {})).status).toBe(200); // closed already: the same answer
    expect((await post(`${B}/v1/groups/nope/abandon`, {})).status).toBe(404);
  });

  it('/healthz says when the shared pool is unreachable, and ok again once it is back', async () => {
    const [A] = await gateways({ groupSize: 1 });
    const health = async () => {
      const r = await fetch(`${A}/healthz`);
      return { status: r.status, body: (await r.json()) as { ok: boolean; shared_pool: { url: string; connected: boolean } } };
    };
    expect(await health()).toMatchObject({ status: 200, body: { ok: true, shared_pool: { url: redis.url, connected: true } } });
    await redis.stop();
    const until = async (status: number) => {
      for (const t0 = Date.now(); Date.now() - t0 < 10_000; await new Promise((r) => setTimeout(r, 100)))
        if ((await health()).status === status) return health();
      throw new Error(`/healthz never answered ${status}`);
    };
    expect(await until(503)).toMatchObject({ body: { ok: false, shared_pool: { connected: false } } });
    await redis.restart();
    expect(await until(200)).toMatchObject({ body: { ok: true, shared_pool: { connected: true } } });
  });

  it('a scoped key minted by one gateway opens its episode on every gateway of the pool; a wrong key is refused saying why', async () => {
    const token = 'service-token';
    const [A, B] = await gateways({ groupSize: 1, token });
    const auth = (k: string) => ({ authorization: `Bearer ${k}` });
    const call = (base: string, k: string, prefix = '') =>
      post(`${base}${prefix}/v1/chat/completions`, { model: 'm', messages: [{ role: 'user', content: 'hi' }] }, auth(k));
    const minted = await post(`${A}/v1/episodes`, { episode_id: 'keyed', agent: 'ag' }, auth(token));
    const { api_key: key } = (await minted.json()) as { api_key: string };
    // Redis holds the key's SHA-256, never the key.
    const r = new Redis(redis.url);
    expect(await r.hkeys('treepack:keys')).toEqual([createHash('sha256').update(key).digest('hex')]);
    expect(JSON.stringify(await r.hgetall('treepack:keys'))).not.toContain(key);
    r.disconnect();
    // The agent's first call is balanced to B: recorded there, under the key's episode and agent.
    const first = await call(B, key);
    expect(first.status, await first.clone().text()).toBe(200);
    const ep = (await (await fetch(`${B}/v1/episodes/keyed`, { headers: auth(token) })).json()) as { agents: string[]; calls: unknown[] };
    expect(ep).toMatchObject({ agents: ['ag'], calls: [expect.anything()] });
    // Confined on B as on A: another episode, or a route for the service token, is refused.
    expect((await call(B, key, '/episodes/other')).status).toBe(403);
    expect((await fetch(`${B}/v1/feed`, { headers: auth(key) })).status).toBe(403);
    // On a third gateway, started after the key was minted, the key opens the episode too; its calls stay on B.
    const c = await Service.create({
      engineUrl: stub.url,
      dataDir: tempDir('tp-redis-gw-'),
      port: 0,
      redis: redis.url,
      groupSize: 1,
      token,
      packer: { tokenizer: 'qwen3' },
    });
    open.push(c);
    const C = await c.listen();
    const elsewhere = await call(C, key);
    expect(elsewhere.status).toBe(409);
    expect(((await elsewhere.json()) as { error: { code: string } }).error.code).toBe('episode_on_another_gateway');
    expect((await post(`${B}/v1/episodes/keyed/finish`, { reward: 1 }, auth(key))).status).toBe(200);
    // A key no gateway minted, and no credentials at all, are refused with messages that say which.
    const wrong = await call(C, 'tp-' + 'x'.repeat(24));
    expect(wrong.status).toBe(401);
    expect(((await wrong.json()) as { error: { message: string } }).error.message).toMatch(
      /wrong bearer token: neither this service's --token nor a scoped API key of its shared pool/,
    );
    const none = await post(`${C}/v1/chat/completions`, { model: 'm', messages: [{ role: 'user', content: 'hi' }] });
    expect(((await none.json()) as { error: { message: string } }).error.message).toMatch(/^missing credentials/);
    // Redis down: a key a gateway has not seen cannot be checked (503); the keys it knows still open their routes.
    const { api_key: later } = (await (await post(`${B}/v1/episodes`, {}, auth(token))).json()) as { api_key: string };
    await redis.stop();
    const unchecked = await call(A, later);
    expect(unchecked.status).toBe(503);
    expect(((await unchecked.json()) as { error: { code: string } }).error.code).toBe('shared_pool_unavailable');
    expect((await fetch(`${A}/v1/models`, { headers: auth(key) })).status).toBe(200);
  });

  it('a trainer killed before acknowledging: its micro-batch is handed out again after the lease, through the other service', async () => {
    const [A, B] = await gateways({ groupSize: 1, leaseMs: 1000 });
    await post(`${A}/buffer/write`, record(0, 0, 1));
    await post(`${B}/buffer/write`, record(1, 0, 1));
    const lost = (await pull(A, 0))!; // this trainer dies with it
    expect(lost.entry.groups).toEqual(['g0']);
    const t0 = Date.now();
    const other = (await pull(B, 0))!;
    expect(other.entry.groups).toEqual(['g1']);
    expect((await post(`${B}/v1/batches/${other.entry.id}/ack`, {})).status).toBe(200);
    expect(await pull(B, 0)).toBeUndefined(); // leased: not handed out twice
    const again = (await pull(B, 0, 10))!;
    expect(Date.now() - t0).toBeGreaterThanOrEqual(900);
    expect(again.entry.id).toBe(lost.entry.id);
    expect(again.bytes.equals(lost.bytes)).toBe(true);
    expect((await post(`${B}/v1/batches/${again.entry.id}/ack`, {})).status).toBe(200);
    const twice = await post(`${A}/v1/batches/${again.entry.id}/ack`, {});
    expect(twice.status).toBe(200); // acknowledged before, through the other service: answered, nothing changes
    expect(await twice.json()).toMatchObject({ step_done: true, repeated: true, trainer_version: 2 });
    expect(await pull(A, 0)).toBeUndefined();
    expect(((await (await fetch(`${A}/v1/feed`)).json()) as { trainer_version: number }).trainer_version).toBe(2);
    expect(await (await fetch(`${B}/metrics`)).text()).toMatch(/treepack_micro_batches_total\{event="reissued"\} 1/);
  });

  it('Redis killed -9 and restarted: nothing acknowledged lost, nothing acknowledged handed out again', async () => {
    const [A, B] = await gateways({ groupSize: 1, leaseMs: 1000 });
    const GROUPS = 10;
    for (let g = 0; g < 6; g++) expect((await post(`${g % 2 ? B : A}/buffer/write`, record(g, 0, g))).status).toBe(200);
    const acked = new Map<string, string[]>(); // micro-batch id → its groups
    for (let i = 0; i < 3; i++) {
      const mb = (await pull(i % 2 ? B : A, 0))!;
      expect((await post(`${A}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);
      acked.set(mb.entry.id, mb.entry.groups);
    }
    const unacked = (await pull(B, 0))!; // handed out, not acknowledged when Redis dies

    // Redis dies and comes back from its append-only file while producers keep writing to both gateways: a write
    // during the outage is refused at once (503 shared_pool_unavailable) and the producer writes it again.
    const write = async (base: string, g: number) => {
      for (const t0 = Date.now(); Date.now() - t0 < 15_000; await new Promise((r) => setTimeout(r, 100))) {
        const r = await post(`${base}/buffer/write`, record(g, 0, 1));
        if (r.status === 200) return;
        expect(r.status).toBe(503);
        expect(((await r.json()) as { error: { code: string } }).error.code).toBe('shared_pool_unavailable');
      }
      throw new Error(`write of group ${g} never taken`);
    };
    const writes = Promise.all(Array.from({ length: GROUPS - 6 }, (_, i) => write(i % 2 ? A : B, 6 + i)));
    await redis.restart();
    await writes;
    for (const base of [A, B])
      for (const t0 = Date.now(); (await fetch(`${base}/healthz`)).status !== 200; await new Promise((r) => setTimeout(r, 100)))
        expect(Date.now() - t0).toBeLessThan(15_000);

    const after: Got[] = [];
    for (let idle = 0; idle < 2;) {
      const mb = await pull(after.length % 2 ? A : B, 0, 1.5);
      if (!mb) {
        idle++;
        continue;
      }
      after.push(mb);
      expect((await post(`${B}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);
    }
    // Nothing acknowledged is handed out again; the one leased at the crash is, once; every group is trained once.
    for (const mb of after) expect(acked.has(mb.entry.id), `${mb.entry.id} acknowledged before the restart`).toBe(false);
    expect(after.filter((mb) => mb.entry.id === unacked.entry.id)).toHaveLength(1);
    const groups = [...acked.values(), ...after.map((mb) => mb.entry.groups)].flat();
    expect(groups.sort()).toEqual(Array.from({ length: GROUPS }, (_, g) => `g${g}`).sort());
    expect(((await (await fetch(`${A}/v1/feed`)).json()) as { trainer_version: number }).trainer_version).toBe(GROUPS);
  });

  it('a gateway that died between its log and Redis ships on restart, once; other feed options are refused', async () => {
    redis = await startRedis();
    const dir = tempDir('tp-redis-gw-');
    // The finish is in the gateway's log but never reached Redis (recorded here without the shared pool).
    const local = await Service.create({ packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, dataDir: dir, port: 0 });
    const L = await local.listen();
    expect(
      (
        await post(
          `${L}/v1/chat/completions`,
          { model: 'm', messages: [{ role: 'user', content: 'hi' }] },
          { 'x-treepack-episode': 'late' },
        )
      ).status,
    ).toBe(200);
    expect((await post(`${L}/v1/episodes/late/finish`, { reward: 1 })).status).toBe(200);
    await local.close();

    const opts = { packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, port: 0, redis: redis.url };
    let a = await Service.create({ ...opts, dataDir: dir });
    const b = await Service.create({ ...opts, dataDir: tempDir('tp-redis-gw-') });
    open.push(b);
    const B = await b.listen();
    const mb = (await pull(B, 0))!;
    expect(mb.seqIds.map(episodeOf)).toEqual(['late']);
    expect((await post(`${B}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);

    // Died again after Redis took the episode and before its log said so: shipped again, counted once.
    await a.close();
    const log = join(dir, 'events.jsonl');
    const lines = readFileSync(log, 'utf8').trimEnd().split('\n');
    expect(JSON.parse(lines.at(-1)!)).toEqual({ type: 'ship', episode: 'late' });
    writeFileSync(log, lines.slice(0, -1).join('\n') + '\n');
    a = await Service.create({ ...opts, dataDir: dir });
    open.push(a);
    expect(JSON.parse(readFileSync(log, 'utf8').trimEnd().split('\n').at(-1)!)).toEqual({ type: 'ship', episode: 'late' });
    expect(await pull(B, 0, 1)).toBeUndefined();

    await expect(Service.create({ ...opts, dataDir: tempDir('tp-redis-gw-'), groupSize: 2 })).rejects.toThrow(
      /other feed options.*"groupSize":1/,
    );
    // Packer options compare resolved: the defaults spelled out (as the CLI does) agree with them left out; a
    // real difference is refused, naming the value in use.
    open.push(
      await Service.create({
        ...opts,
        dataDir: tempDir('tp-redis-gw-'),
        packer: { tokenizer: 'qwen3', backend: 'auto', advantages: 'grpo', windowTokens: DEFAULT_WINDOW_TOKENS },
      }),
    );
    await expect(
      Service.create({ ...opts, dataDir: tempDir('tp-redis-gw-'), packer: { tokenizer: 'qwen3', windowTokens: 1000 } }),
    ).rejects.toThrow(new RegExp(`other feed options.*"windowTokens":${DEFAULT_WINDOW_TOKENS}`));
    await expect(Service.create({ ...opts, dataDir: tempDir('tp-redis-gw-'), redis: 'redis://127.0.0.1:1' })).rejects.toThrow(
      /redis:\/\/127.0.0.1:1 is unreachable/,
    );
  });

  it("slime's get_rollout_data: whole groups from the shared pool, each read once, whichever service answers", async () => {
    const [A, B] = await gateways({ groupSize: 2 });
    await post(`${A}/buffer/write`, record(0, 0, 1));
    await post(`${B}/buffer/write`, record(1, 0, 0));
    await post(`${B}/buffer/write`, record(0, 1, 0));
    type Read = { success: boolean; data: { data: { uid: string }[]; meta_info: { num_groups: number } } };
    const first = (await (await post(`${A}/get_rollout_data`, {})).json()) as Read;
    expect(first.data.data.map((r) => r.uid)).toEqual(['g0-e0', 'g0-e1']); // g1 is not whole yet
    expect(((await (await post(`${B}/get_rollout_data`, {})).json()) as Read).success).toBe(false);
    await post(`${A}/buffer/write`, record(1, 1, 1));
    const second = (await (await post(`${B}/get_rollout_data`, {})).json()) as Read;
    expect(second.data.data.map((r) => r.uid)).toEqual(['g1-e0', 'g1-e1']);
    expect(second.data.meta_info.num_groups).toBe(1);
    // A record for an instance already read starts its next round (slime's next epoch), read once it is whole.
    expect((await post(`${A}/buffer/write`, record(1, 2, 1))).status).toBe(200);
    expect(((await (await post(`${B}/get_rollout_data`, {})).json()) as Read).success).toBe(false);
    expect((await post(`${B}/buffer/write`, record(1, 3, 0))).status).toBe(200);
    const third = (await (await post(`${A}/get_rollout_data`, {})).json()) as Read;
    expect(third.data.data.map((r) => r.uid)).toEqual(['g1-e2', 'g1-e3']);
  });

  it('a flush is shared and bounded: the groups numbered before it form a smaller step on any service, later ones wait for full steps', async () => {
    const [A, B] = await gateways({ groupSize: 1, groupsPerStep: 2 });
    expect((await post(`${A}/buffer/write`, record(0, 0, 1))).status).toBe(200);
    expect(await pull(B, 0)).toBeUndefined(); // one group of a two-group step
    const flushed = await post(`${B}/v1/feed/flush`, {});
    expect(await flushed.json()).toEqual({ flushing: true, flush_below: 1 });
    expect((await pull(A, 0))!.entry.groups).toEqual(['g0']);
    // A new rollout: its groups form full steps again, whichever service numbered them.
    expect((await post(`${B}/buffer/write`, record(1, 0, 1))).status).toBe(200);
    expect(await pull(A, 0)).toBeUndefined();
    expect(await pull(B, 0)).toBeUndefined();
    expect((await post(`${A}/buffer/write`, record(2, 0, 1))).status).toBe(200);
    expect((await pull(B, 0))!.entry.groups).toEqual(['g1', 'g2']);
  });

  it('the groups stream is trimmed as groups are taken; a restarted gateway and trainer carry on from the trimmed state', async () => {
    redis = await startRedis();
    const r = new Redis(redis.url);
    try {
      const opts: Omit<ServiceOptions, 'dataDir'> = {
        packer: { tokenizer: 'qwen3' },
        engineUrl: stub.url,
        port: 0,
        redis: redis.url,
        groupSize: 1,
        leaseMs: 1000,
        policy: { kind: 'windowed-fifo', window: 3 },
      };
      const dirA = tempDir('tp-redis-gw-');
      let a = await Service.create({ ...opts, dataDir: dirA });
      const b = await Service.create({ ...opts, dataDir: tempDir('tp-redis-gw-') });
      open.push(b);
      let A = await a.listen();
      const B = await b.listen();
      // Group 0 ("slow") is an agent still at work on A; groups 1 and 2 are finished records.
      expect(
        (
          await post(
            `${A}/v1/chat/completions`,
            { model: 'm', messages: [{ role: 'user', content: 'slow task' }] },
            { 'x-treepack-episode': 'slow' },
          )
        ).status,
      ).toBe(200);
      for (const g of [1, 2]) expect((await post(`${B}/buffer/write`, record(g, 0, 1))).status).toBe(200);
      expect(await r.xlen('treepack:groups')).toBe(2);
      const first = (await pull(A, 0))!;
      expect(first.entry.groups).toEqual(['g1']);
      expect((await post(`${A}/v1/batches/${first.entry.id}/ack`, {})).status).toBe(200);
      const held = (await pull(B, 0))!; // its trainer dies before acknowledging
      expect(held.entry.groups).toEqual(['g2']);
      // Groups 1 and 2 are taken out of order (group 0 holds the window's head): no service needs their entries.
      expect(await r.xlen('treepack:groups')).toBe(0);
      expect(await r.get('treepack:front')).toBe('0');
      expect((await r.smembers('treepack:taken')).sort()).toEqual(['1', '2']);
      expect(await r.xlen('treepack:mb:0')).toBe(1); // the acknowledged micro-batch is gone, the held one waits
      // Groups 3 and 4 finish outside the window [0, 3): they wait, and so do their entries.
      for (const g of [3, 4]) expect((await post(`${B}/buffer/write`, record(g, 0, 1))).status).toBe(200);
      expect(await r.xlen('treepack:groups')).toBe(2);

      // Gateway A restarts from its log; the agent finishes its episode there; a trainer rank pulls from A.
      await a.close();
      a = await Service.create({ ...opts, dataDir: dirA });
      open.push(a);
      A = await a.listen();
      const again = (await pull(A, 0, 5))!;
      expect(again.entry.id).toBe(held.entry.id); // the held one, after its lease
      expect(again.bytes.equals(held.bytes)).toBe(true);
      expect((await post(`${A}/v1/batches/${again.entry.id}/ack`, {})).status).toBe(200);
      expect((await post(`${A}/v1/episodes/slow/finish`, { reward: 1 })).status).toBe(200);
      const rest: string[][] = [];
      for (;;) {
        const mb = await pull(rest.length % 2 ? B : A, 0, 1);
        if (!mb) break;
        rest.push(mb.entry.groups);
        expect((await post(`${B}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);
      }
      expect(rest).toEqual([['slow'], ['g3'], ['g4']]);
      for (const base of [A, B]) expect(await pull(base, 0)).toBeUndefined();
      // Everything taken and acknowledged: the shared state is back to its counters.
      expect(await r.xlen('treepack:groups')).toBe(0);
      expect(await r.xlen('treepack:mb:0')).toBe(0);
      expect(await r.get('treepack:front')).toBe('5');
      expect(await r.scard('treepack:taken')).toBe(0);
      expect(await r.exists('treepack:steps')).toBe(0);
      for (const base of [A, B])
        expect(((await (await fetch(`${base}/v1/feed`)).json()) as { trainer_version: number }).trainer_version).toBe(5);
    } finally {
      r.disconnect();
    }
  });

  it('a Redis that may lose acknowledged writes is refused, naming the settings, unless allowed; one that hides its CONFIG is a warning', async () => {
    redis = await startRedis(['--appendonly', 'no', '--appendfsync', 'everysec']);
    const opts = { packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, port: 0, redis: redis.url };
    const refused =
      /shared pool at redis:\/\/127\.0\.0\.1:\d+ may lose what it acknowledges on a crash: appendonly is "no", not yes, appendfsync is "everysec", not always\. Start Redis with --appendonly yes --appendfsync always .*--redis-allow-weak-durability starts anyway/;
    await expect(Service.create({ ...opts, dataDir: tempDir('tp-redis-gw-') })).rejects.toThrow(refused);
    const r = cli(['serve', '--engine', stub.url, '--data', tempDir('tp-redis-gw-'), '--redis', redis.url, '--tokenizer', 'qwen3']);
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(refused);
    const warnings: string[] = [];
    const weak = await Service.create({
      ...opts,
      dataDir: tempDir('tp-redis-gw-'),
      redisAllowWeakDurability: true,
      warn: (m) => warnings.push(m),
    });
    open.push(weak);
    expect(warnings).toHaveLength(1);
    expect(warnings[0]).toMatch(/appendfsync is "everysec", not always.*starting anyway \(--redis-allow-weak-durability\)/);
    const W = await weak.listen();
    expect((await post(`${W}/buffer/write`, record(0, 0, 1))).status).toBe(200);
    expect((await pull(W, 0))!.entry.groups).toEqual(['g0']);
    for (const s of open.splice(0)) await s.close();
    await redis.stop();

    // CONFIG renamed away (as managed Redis services do): the settings cannot be read, so a warning only.
    redis = await startRedis(['--rename-command', 'CONFIG', '']);
    warnings.length = 0;
    const blind = await Service.create({ ...opts, redis: redis.url, dataDir: tempDir('tp-redis-gw-'), warn: (m) => warnings.push(m) });
    open.push(blind);
    expect(warnings).toHaveLength(1);
    expect(warnings[0]).toMatch(
      /cannot check that the shared pool at .* keeps what it acknowledges \(CONFIG GET refused: .*unknown command.*\); it must run with appendonly yes and appendfsync always/,
    );
  });

  it("a service killed -9 while forming a step holds the others up for the form lock's lease only", async () => {
    redis = await startRedis();
    const args = ['--engine', stub.url, '--redis', redis.url, '--tokenizer', 'qwen3'];
    const dying = await startServeProcess([...args, '--data', tempDir('tp-redis-gw-')], { TREEPACK_SERVE_FORM_FAULT: 'locked' });
    const other = await startServeProcess([...args, '--data', tempDir('tp-redis-gw-')]);
    const r = new Redis(redis.url);
    try {
      expect((await post(`${dying.url}/buffer/write`, record(0, 0, 1))).status).toBe(200);
      // Its trainer asks it for a micro-batch: it takes the form lock and dies holding it.
      await fetch(`${dying.url}/v1/batches/next?rank=0`).catch(() => undefined);
      await dying.kill9();
      expect(dying.child.signalCode).toBe('SIGKILL');
      const ttl = await r.pttl('treepack:form-lock');
      expect(ttl).toBeLessThanOrEqual(2000); // a short lease (or expired already), not the holder's whole packing time
      const t0 = Date.now();
      const mb = (await pull(other.url, 0, 10))!;
      expect(mb.entry.groups).toEqual(['g0']);
      expect(Date.now() - t0).toBeLessThan(8000);
      expect((await post(`${other.url}/v1/batches/${mb.entry.id}/ack`, {})).status).toBe(200);
      expect(await r.exists('treepack:form-lock')).toBe(0); // released by the service that formed the step
    } finally {
      r.disconnect();
      await dying.kill9();
      await other.kill9();
    }
  });
});
