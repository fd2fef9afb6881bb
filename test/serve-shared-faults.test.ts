/**
 * The shared pool's two faults a deployment meets (a real redis-server on loopback):
 * - D5, an episode whose calls reach two gateways: the first gateway to see an episode records all of it; a call,
 *   finish or abandon through another gateway is refused (409 episode_on_another_gateway, naming the gateway of
 *   its first call) and records nothing there, so nothing is lost silently. A restarted gateway keeps its name.
 * - D8, Redis down: requests that need Redis (a call opening an episode, a slime write, a trainer's pull or ack)
 *   fail at once with 503 shared_pool_unavailable instead of waiting out the outage; calls continuing an episode
 *   and finishes are answered (they are durable in the gateway's log, and shipped once Redis is back); /healthz
 *   answers 503; after Redis returns, nothing acknowledged is lost and the feed carries on.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { Redis } from 'ioredis';
import type { ServiceOptions } from '../src/serve/service.js';
import { inProcessServices } from './helpers/in-process.js';
import { redisAvailable, startRedis, type RedisServer } from './helpers/redis.js';
import { tempDir } from './helpers/serve.js';

/** Every request bounded: one that waits out an outage fails the test instead of hanging it. */
const post = (url: string, body: unknown) =>
  fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(4000),
  });
const get = (url: string) => fetch(url, { signal: AbortSignal.timeout(4000) });
const chat = (base: string, episode: string, content: string[], group?: string) =>
  post(`${base}${group ? `/groups/${group}` : ''}/episodes/${episode}/v1/chat/completions`, {
    model: 'm',
    messages: content.map((c, i) => ({ role: i % 2 ? 'assistant' : 'user', content: c })),
  });
type ErrorBody = { error: { message: string; code: string | null } };

const run = redisAvailable('serve-shared-faults') ? describe : describe.skip;

run('shared pool faults', { timeout: 60_000 }, () => {
  let redis: RedisServer;
  const services = inProcessServices('tp-faults-');
  afterEach(async () => {
    await redis?.stop();
  });
  const make = (opts: Partial<ServiceOptions> = {}) => services.start({ redis: redis.url, ...opts });

  it("D5: an episode's call through a second gateway is refused at once, naming the first; nothing is lost silently", async () => {
    redis = await startRedis();
    const dirA = tempDir('tp-faults-');
    let a = await make({ groupSize: 1, dataDir: dirA });
    const b = await make({ groupSize: 1 });
    expect((await chat(a.base, 'sp1', ['first'])).status).toBe(200);
    const engineCalls = services.stub!.calls;
    const foreign = await chat(b.base, 'sp1', ['first', 'x', 'second']);
    expect(foreign.status).toBe(409);
    expect(services.stub!.calls).toBe(engineCalls); // refused before the engine generates anything
    const body = (await foreign.json()) as ErrorBody;
    expect(body.error.code).toBe('episode_on_another_gateway');
    expect(body.error.message).toContain(`episode "sp1" is recorded by another gateway (`);
    expect(body.error.message).toContain(`:${dirA}#`); // the first gateway's host and data directory
    expect((await get(`${b.base}/v1/episodes/sp1`)).status).toBe(404); // nothing recorded there
    // its finish through the other gateway is refused too (it would end an episode that gateway never saw)
    const finishB = await post(`${b.base}/v1/episodes/sp1/finish`, { reward: 1 });
    expect(finishB.status).toBe(409);
    expect(((await finishB.json()) as ErrorBody).error.code).toBe('episode_on_another_gateway');

    // The gateway restarts on its data directory: still the same gateway, its episode carries on there.
    await services.stop(a.svc);
    a = await make({ groupSize: 1, dataDir: dirA });
    expect((await chat(a.base, 'sp1', ['first', 'x', 'second'])).status).toBe(200);
    expect((await post(`${a.base}/v1/episodes/sp1/finish`, { reward: 1 })).status).toBe(200);
    const r = new Redis(redis.url);
    try {
      expect(await r.exists('treepack:ep:sp1')).toBe(1);
      const res = await get(`${b.base}/v1/batches/next?wait=5`);
      expect(res.status).toBe(200);
      const entry = JSON.parse(res.headers.get('x-treepack-entry')!) as { id: string; groups: string[] };
      expect(entry.groups).toEqual(['sp1']);
      expect((await post(`${b.base}/v1/batches/${entry.id}/ack`, {})).status).toBe(200);
      expect(await r.exists('treepack:ep:sp1')).toBe(0); // the claim goes with the group's records
    } finally {
      r.disconnect();
    }
    // An episode first seen by the other gateway belongs to it.
    expect((await chat(b.base, 'sp2', ['hi'])).status).toBe(200);
    expect(((await (await chat(a.base, 'sp2', ['hi'])).json()) as ErrorBody).error.code).toBe('episode_on_another_gateway');
  });

  it('D8: Redis down: what needs it fails at once with 503 shared_pool_unavailable, nothing acknowledged is lost, and all resumes', async () => {
    redis = await startRedis();
    const { base } = await make({ groupSize: 1, leaseMs: 60_000 });
    // Before the outage: episode o1 under way, one micro-batch handed out and not yet acknowledged.
    expect((await chat(base, 'o1', ['task'])).status).toBe(200);
    expect((await chat(base, 'd1', ['done task'])).status).toBe(200);
    expect((await post(`${base}/v1/episodes/d1/finish`, { reward: 1 })).status).toBe(200);
    const held = await get(`${base}/v1/batches/next?wait=5`);
    expect(held.status).toBe(200);
    const heldId = held.headers.get('x-treepack-id')!;

    await redis.stop();
    const until = async (status: number) => {
      for (const t0 = Date.now(); Date.now() - t0 < 15_000; await new Promise((r) => setTimeout(r, 100)))
        if ((await get(`${base}/healthz`)).status === status) return;
      throw new Error(`/healthz never answered ${status}`);
    };
    await until(503);
    const metrics = await get(`${base}/metrics`); // still scraped: the shared pool's depths read NaN meanwhile
    expect(metrics.status).toBe(200);
    expect(await metrics.text()).toMatch(/^treepack_micro_batches_ready nan$/im); // prom-client writes "Nan", which Prometheus parses;
    const fast = async (p: Promise<Response>) => {
      const t0 = Date.now();
      const res = await p;
      const ms = Date.now() - t0;
      expect(ms, 'answered within a bounded wait').toBeLessThan(1500);
      return res;
    };
    const unavailable = async (p: Promise<Response>) => {
      const res = await fast(p);
      expect(res.status).toBe(503);
      const body = (await res.json()) as ErrorBody;
      expect(body.error.code).toBe('shared_pool_unavailable');
      expect(body.error.message).toMatch(
        new RegExp(`the shared pool at ${redis.url} is unreachable \\(.*\\); retry once GET /healthz answers 200`),
      );
    };
    await unavailable(chat(base, 'n1', ['new episode'])); // a new episode is claimed in Redis first
    await unavailable(get(`${base}/v1/batches/next?wait=2`));
    await unavailable(post(`${base}/v1/batches/${heldId}/ack`, {}));
    await unavailable(
      post(`${base}/buffer/write`, {
        uid: 'w1',
        instance_id: 'w',
        messages: [
          { role: 'user', content: 'q' },
          { role: 'assistant', content: 'a' },
        ],
        reward: 1,
      }),
    );
    // An episode under way carries on, and its finish is durable in the gateway's log: answered, shipped later.
    expect((await fast(chat(base, 'o1', ['task', 'x', 'more']))).status).toBe(200);
    const fin = await fast(post(`${base}/v1/episodes/o1/finish`, { reward: 0.5 }));
    expect(fin.status).toBe(200);
    expect(await fin.json()).toMatchObject({ episode_id: 'o1', group_episodes: null });

    await redis.restart();
    await until(200);
    // The acknowledgement the outage refused is taken now, once; o1 reaches the trainer; new episodes open again.
    expect((await post(`${base}/v1/batches/${heldId}/ack`, {})).status).toBe(200);
    const twice = await post(`${base}/v1/batches/${heldId}/ack`, {});
    expect(twice.status).toBe(200); // acknowledged before: answered, and nothing changes
    expect(await twice.json()).toMatchObject({ step_done: true, repeated: true });
    const next = await get(`${base}/v1/batches/next?wait=5`);
    expect(next.status).toBe(200);
    expect(JSON.parse(next.headers.get('x-treepack-entry')!)).toMatchObject({ groups: ['o1'] });
    expect((await post(`${base}/v1/batches/${next.headers.get('x-treepack-id')}/ack`, {})).status).toBe(200);
    expect((await chat(base, 'n1', ['new episode'])).status).toBe(200);
  });
});
