/**
 * The service as agent teams run it (issue 22): a scoped key opens its own episode only, on every route; the log
 * is private and holds no key; episodes and groups are abandoned (explicitly, by a finish without a call, by the
 * idle timeout) so one crashed agent never stalls the windowed FIFO, for the trainer or for slime; a retried call
 * or finish is recorded once; engine failures are counted.
 */
import { describe, expect, it } from 'vitest';
import { readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { parseSafetensors } from '../src/io/safetensors.js';
import type { Service, ServiceOptions } from '../src/serve/service.js';
import { tempDir } from './helpers/serve.js';
import { inProcessServices } from './helpers/in-process.js';

const post = (url: string, body: unknown, headers: Record<string, string> = {}) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) });
const M = (text: string) => ({ messages: [{ role: 'user', content: text }] });

const services = inProcessServices('tp-agents-');

async function service(opts: Partial<ServiceOptions> = {}): Promise<{ base: string; svc: Service; data: string }> {
  // a data directory the service creates (0700)
  const { base, svc } = await services.start({ dataDir: join(tempDir('tp-agents-'), 'data'), ...opts });
  return { base, svc, data: svc.opts.dataDir };
}

async function restart(svc: Service, opts: Partial<ServiceOptions>): Promise<string> {
  await services.stop(svc);
  return (await service({ ...opts, dataDir: svc.opts.dataDir })).base;
}

/** Pulls and acknowledges what is ready; the groups of each micro-batch. */
async function drain(base: string, wait = 0): Promise<string[][]> {
  const out: string[][] = [];
  for (;;) {
    const res = await fetch(`${base}/v1/batches/next?wait=${wait}`);
    if (res.status === 204) return out;
    expect(res.status).toBe(200);
    const entry = JSON.parse(res.headers.get('x-treepack-entry')!) as { id: string; groups: string[] };
    parseSafetensors(new Uint8Array(await res.arrayBuffer()));
    expect((await post(`${base}/v1/batches/${entry.id}/ack`, {})).status).toBe(200);
    out.push(entry.groups);
  }
}

describe('scoped API keys', { timeout: 60_000 }, () => {
  it('open their own episode only, on every route, with and without --token', async () => {
    for (const token of [undefined, 's3cret']) {
      const { base, data } = await service(token ? { token } : {});
      const T: Record<string, string> = token ? { authorization: `Bearer ${token}` } : {};
      expect((await post(`${base}/episodes/victim/v1/chat/completions`, M('hi'), T)).status).toBe(200);
      const made = (await (await post(`${base}/v1/episodes`, { episode_id: 'attacker', agent: 'planner', group: 'G' }, T)).json()) as {
        api_key: string;
      };
      const K = { authorization: `Bearer ${made.api_key}` };
      const refused = [
        post(`${base}/episodes/victim/v1/chat/completions`, M('injected'), K),
        post(`${base}/groups/G/episodes/victim/v1/chat/completions`, M('injected'), K),
        post(`${base}/v1/chat/completions`, M('injected'), { ...K, 'x-treepack-episode': 'other' }),
        post(`${base}/v1/completions`, { prompt: 'injected' }, { ...K, 'x-treepack-episode': 'victim' }),
        post(`${base}/v1/chat/completions`, M('injected'), { ...K, 'x-treepack-group': 'H' }),
        post(`${base}/groups/H/episodes/attacker/v1/chat/completions`, M('injected'), K),
        post(`${base}/v1/chat/completions`, M('injected'), { ...K, 'x-treepack-agent': 'coder' }),
        post(`${base}/v1/episodes/victim/finish`, { reward: 1 }, K),
        post(`${base}/v1/episodes/victim/abandon`, {}, K),
        post(`${base}/v1/groups/G/abandon`, {}, K),
        post(`${base}/v1/episodes`, { episode_id: 'victim' }, K),
        fetch(`${base}/v1/episodes/victim`, { headers: K }),
        fetch(`${base}/v1/batches/next`, { headers: K }),
        post(`${base}/buffer/write`, {}, K),
        fetch(`${base}/episodes/victim/v1/models`, { headers: K }),
      ];
      for (const r of await Promise.all(refused)) expect(r.status, `${r.url}: ${await r.clone().text()}`).toBe(403);
      // Its own episode, by the key alone or by its URL, works.
      expect((await post(`${base}/v1/chat/completions`, M('mine'), K)).status).toBe(200);
      expect(
        (await post(`${base}/groups/G/episodes/attacker/v1/chat/completions`, M('mine again'), { ...K, 'x-treepack-agent': 'planner' }))
          .status,
      ).toBe(200);
      expect((await fetch(`${base}/episodes/attacker/v1/models`, { headers: K })).status).toBe(200);
      const victim = (await (await fetch(`${base}/v1/episodes/victim`, { headers: T })).json()) as { calls: unknown[]; agents: string[] };
      expect(victim.calls).toHaveLength(1);
      expect(victim.agents).toEqual([]);
      expect(
        (await (await fetch(`${base}/v1/episodes/attacker`, { headers: T })).json()) as { group: string; agents: string[] },
      ).toMatchObject({ group: 'G', agents: ['planner'] });
      expect((await post(`${base}/v1/episodes/attacker/finish`, { reward: 1 }, K)).status).toBe(200);

      // The log is the owner's only and holds the key's hash, not the key.
      const log = join(data, 'events.jsonl');
      expect(statSync(log).mode & 0o777).toBe(0o600);
      expect(statSync(data).mode & 0o777).toBe(0o700);
      expect(readFileSync(log, 'utf8')).not.toContain(made.api_key);
    }
  });

  it('still authenticate after a restart and after compaction, from their hash', async () => {
    const { base, svc } = await service({ token: 't', compactBytes: 1 });
    const T = { authorization: 'Bearer t' };
    const keys: string[] = [];
    for (const ep of ['a', 'b'])
      keys.push(((await (await post(`${base}/v1/episodes`, { episode_id: ep }, T)).json()) as { api_key: string }).api_key);
    expect((await post(`${base}/v1/chat/completions`, M('a1'), { authorization: `Bearer ${keys[0]}` })).status).toBe(200);
    const again = await restart(svc, { token: 't', compactBytes: 1 });
    expect((await post(`${again}/v1/chat/completions`, M('b1'), { authorization: `Bearer ${keys[1]}` })).status).toBe(200);
    expect((await post(`${again}/v1/chat/completions`, M('x'), { authorization: 'Bearer tp-not-a-key' })).status).toBe(401);
    expect(((await (await fetch(`${again}/v1/episodes/b`, { headers: T })).json()) as { calls: unknown[] }).calls).toHaveLength(1);
  });
});

describe('abandoned episodes and groups', { timeout: 60_000 }, () => {
  /** D3's reproduction: a2 of group A never calls; groups B..G finish behind it. */
  async function stuckHead(base: string) {
    expect((await post(`${base}/groups/A/episodes/a1/v1/chat/completions`, M('a1'))).status).toBe(200);
    expect((await post(`${base}/v1/episodes/a1/finish`, { reward: 1 })).status).toBe(200);
    expect((await post(`${base}/v1/episodes`, { episode_id: 'a2', group: 'A' })).status).toBe(200);
    for (const g of 'BCDEFG') {
      for (const e of [1, 2]) {
        expect((await post(`${base}/groups/${g}/episodes/${g}${e}/v1/chat/completions`, M(g))).status).toBe(200);
        expect((await post(`${base}/v1/episodes/${g}${e}/finish`, { reward: e })).status).toBe(200);
      }
    }
  }

  it('a finish without a call abandons the episode: its group trains with the finished one, and the feed goes on', async () => {
    const { base } = await service({ groupSize: 2 });
    await stuckHead(base);
    expect((await drain(base)).map((g) => g[0])).toEqual(['B', 'C', 'D']); // the window is stuck on A
    const r = await post(`${base}/v1/episodes/a2/finish`, { reward: 0 });
    expect(r.status).toBe(200);
    expect(await r.json()).toMatchObject({ episode_id: 'a2', group: 'A', abandoned: true, group_finished: true });
    // a retry answers the same
    expect(await (await post(`${base}/v1/episodes/a2/finish`, { reward: 0 })).json()).toMatchObject({ abandoned: true });
    expect((await drain(base)).map((g) => g[0])).toEqual(['A', 'E', 'F', 'G']);
    expect((await post(`${base}/episodes/a2/v1/chat/completions`, M('late'))).status).toBe(409);
  });

  it('the idle timeout abandons a stuck group, for the trainer and for slime, and a gauge shows its age', async () => {
    for (const reader of ['trainer', 'slime'] as const) {
      const { base, svc } = await service({ groupSize: 2, idleTimeoutMs: 1500 });
      await stuckHead(base);
      const metrics = await (await fetch(`${base}/metrics`)).text();
      expect(Number(/^treepack_oldest_open_group_seconds (\S+)$/m.exec(metrics)![1])).toBeGreaterThan(0);
      const t0 = Date.now();
      if (reader === 'trainer') {
        const got: string[] = [];
        while (got.length < 7 && Date.now() - t0 < 10_000) got.push(...(await drain(base, 1)).map((g) => g[0]));
        expect(got).toEqual(['B', 'C', 'D', 'A', 'E', 'F', 'G']);
      } else {
        const got: string[] = [];
        while (got.length < 13 && Date.now() - t0 < 10_000) {
          const r = (await (await post(`${base}/get_rollout_data`, {})).json()) as { data: { data: { uid: string }[] } };
          got.push(...r.data.data.map((x) => x.uid));
          await new Promise((res) => setTimeout(res, 100));
        }
        expect(got).toContain('a1');
        expect(got).not.toContain('a2');
        expect(got).toHaveLength(13);
      }
      expect(Date.now() - t0).toBeLessThan(6_000);
      const after = await (await fetch(`${base}/metrics`)).text();
      expect(Number(/^treepack_oldest_open_group_seconds (\S+)$/m.exec(after)![1])).toBe(0);
      await services.stop(svc);
    }
  });

  it('explicit abandonment of an episode and of a group, kept across a restart', async () => {
    const { base, svc } = await service({ groupSize: 3 });
    for (const e of ['x1', 'x2']) expect((await post(`${base}/groups/X/episodes/${e}/v1/chat/completions`, M(e))).status).toBe(200);
    expect((await post(`${base}/v1/episodes/x1/finish`, { reward: 1 })).status).toBe(200);
    const a = await post(`${base}/v1/episodes/x2/abandon`, {});
    expect(await a.json()).toMatchObject({ abandoned: true, group_finished: false, group_episodes: 2 });
    expect((await post(`${base}/v1/episodes/x2/finish`, { reward: 1 })).status).toBe(409); // its reward is not taken
    expect((await post(`${base}/v1/groups/nope/abandon`, {})).status).toBe(404);
    const g = await post(`${base}/v1/groups/X/abandon`, {});
    expect(await g.json()).toEqual({ group: 'X', abandoned: true, episodes_finished: 1, episodes_abandoned: 1 });
    expect((await post(`${base}/groups/X/episodes/x3/v1/chat/completions`, M('x3'))).status).toBe(409);
    const again = await restart(svc, { groupSize: 3 });
    expect(((await (await fetch(`${again}/v1/episodes/x2`)).json()) as { abandoned: string }).abandoned).toBe('abandoned');
    const res = await fetch(`${again}/v1/batches/next`);
    expect(res.status).toBe(200);
    const seqs = JSON.parse(parseSafetensors(new Uint8Array(await res.arrayBuffer())).metadata.sequence_ids) as string[];
    expect(seqs.map((s) => s.split('/')[0])).toEqual(['x1']); // the abandoned episode is not trained
  });
});

describe('retries', { timeout: 60_000 }, () => {
  it('a call retried with its Idempotency-Key is recorded once and answered as recorded; a finish retried with the same body is 200', async () => {
    const { base, svc } = await service();
    const H = { 'idempotency-key': 'req-1' };
    const first = (await (await post(`${base}/episodes/e/v1/chat/completions`, M('q'), H)).json()) as {
      choices: { message: { content: string } }[];
    };
    const retry = await post(`${base}/episodes/e/v1/chat/completions`, M('q'), H);
    expect(retry.status).toBe(200);
    expect(retry.headers.get('x-treepack-replayed')).toBe('true');
    expect(((await retry.json()) as typeof first).choices[0].message).toEqual(first.choices[0].message);
    // concurrent duplicates, and a retry after a restart (the answer lost with the process)
    const answers = await Promise.all(
      [1, 2, 3].map(async () => (await post(`${base}/episodes/e/v1/chat/completions`, M('q2'), { 'idempotency-key': 'req-2' })).text()),
    );
    expect(new Set(answers).size).toBe(1); // one call, one answer, byte for byte
    const again = await restart(svc, {});
    const replayed = await post(`${again}/episodes/e/v1/chat/completions`, M('q2'), { 'idempotency-key': 'req-2' });
    expect(await replayed.text()).toBe(answers[0]);
    // the key with another body (here: streamed) is the client's error, not a replay
    expect(
      (await post(`${again}/episodes/e/v1/chat/completions`, { ...M('q2'), stream: true }, { 'idempotency-key': 'req-2' })).status,
    ).toBe(422);
    // without a key, the same request is a new call (an agent may sample twice)
    expect((await post(`${again}/episodes/e/v1/chat/completions`, M('q'))).status).toBe(200);
    const calls = ((await (await fetch(`${again}/v1/episodes/e`)).json()) as { calls: unknown[] }).calls;
    expect(calls).toHaveLength(3);
    expect(services.stub!.calls).toBe(3);

    expect((await post(`${again}/v1/episodes/e/finish`, { reward: 0.5, metadata: { k: 1 } })).status).toBe(200);
    expect((await post(`${again}/v1/episodes/e/finish`, { reward: 0.5, metadata: { k: 1 } })).status).toBe(200);
    expect((await post(`${again}/v1/episodes/e/finish`, { reward: 1 })).status).toBe(409);
  });
});

describe('engine', { timeout: 60_000 }, () => {
  it('lists its models under every base URL, sending the engine key', async () => {
    const { base } = await service({ engineApiKey: 'ek' });
    services.stub!.apiKey = 'ek';
    for (const prefix of ['', '/episodes/e', '/groups/g/episodes/e']) {
      const r = await fetch(`${base}${prefix}/v1/models`);
      expect(r.status, prefix).toBe(200);
      expect(((await r.json()) as { data: { id: string }[] }).data[0].id).toBe('stub');
    }
  });

  it('failures are counted in treepack_calls_total', async () => {
    const { base } = await service({ engineTimeoutMs: 300 });
    services.stub!.mode = 'hang';
    expect((await post(`${base}/episodes/e/v1/chat/completions`, M('q'))).status).toBe(504);
    services.stub!.mode = 'garbage';
    expect((await post(`${base}/episodes/e/v1/chat/completions`, M('q'))).status).toBe(502);
    await services.stub!.close();
    expect((await post(`${base}/episodes/e/v1/chat/completions`, M('q'))).status).toBe(502);
    const m = await (await fetch(`${base}/metrics`)).text();
    for (const outcome of ['engine_timeout', 'engine_garbage', 'engine_unreachable'])
      expect(m).toMatch(new RegExp(`treepack_calls_total\\{endpoint="chat",outcome="${outcome}"\\} 1`));
  });
});
