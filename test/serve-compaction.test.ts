/**
 * Log compaction: a service whose log is compacted at every doubling answers every request as one whose log is
 * never compacted, before and after a restart (the same steps, the same micro-batches, the same refusals of late
 * duplicates); a kill -9 of `treepack serve` inside a compaction, before and after its rename, loses nothing
 * acknowledged as recorded and hands out again nothing acknowledged by the trainer; appends are answered while
 * the compaction rewrites the log, and what they appended follows its result.
 */
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { existsSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseSafetensors } from '../src/io/safetensors.js';
import { DurableLog } from '../src/serve/log.js';
import { Service } from '../src/serve/service.js';
import { slimeRecord as record, startServeProcess, tempDir, type ServeProcess } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const post = (url: string, body: unknown, headers: Record<string, string> = {}) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) });

interface Pulled {
  id: string;
  seqIds: string[];
  entry: Record<string, unknown>;
}

async function pull(base: string, wait = 0): Promise<Pulled | undefined> {
  const res = await fetch(`${base}/v1/batches/next?rank=0&wait=${wait}`);
  if (res.status !== 200) return undefined;
  const seqIds = JSON.parse(parseSafetensors(new Uint8Array(await res.arrayBuffer())).metadata.sequence_ids) as string[];
  const { id, feed_step, groups, trainer_version, policy_version, staleness, packed_tokens } = JSON.parse(
    res.headers.get('x-treepack-entry')!,
  ) as Record<string, unknown>;
  return { id: id as string, seqIds, entry: { feed_step, groups, trainer_version, policy_version, staleness, packed_tokens } };
}

let stub: StubEngine;
const open: Service[] = [];
afterEach(async () => {
  for (const s of open.splice(0)) await s.close();
});
afterAll(async () => {
  await stub?.close();
});

/** What a client can observe of a service, and what its metrics count. */
async function observe(svc: Service, base: string) {
  const pool = svc.pool;
  const groups = pool.bySeq.map((g) => [g.id, g.size, g.consumed, g.finished, g.episodes.length]);
  const episodes = [...pool.episodes.values()]
    .sort((a, b) => a.id.localeCompare(b.id))
    .map((ep) => [ep.id, ep.group, ep.finished, ep.reward ?? null, ep.calls.map((c) => c.output)]);
  const feed = (await (await fetch(`${base}/v1/feed`)).json()) as Record<string, unknown>;
  return { groups, episodes, counters: pool.counters, depth: pool.depth(), pendingBytes: pool.pendingBytes, keys: pool.keys.size, feed };
}

/** The same traffic against a service whose log compacts at `compactBytes`; a transcript of every answer. */
async function scenario(compactBytes: number) {
  const engine = await startStubEngine(); // its own: the stub numbers its replies
  try {
    return await traffic(engine, compactBytes);
  } finally {
    await engine.close();
  }
}

async function traffic(engine: StubEngine, compactBytes: number) {
  const dataDir = tempDir('tp-compact-');
  const opts = {
    engineUrl: engine.url,
    dataDir,
    port: 0,
    groupSize: 2,
    compactBytes,
    packer: { tokenizer: 'qwen3', budget: { maxTokens: 48 } },
    groupsPerStep: 2,
    policy: { kind: 'windowed-fifo' as const, window: 3 },
  };
  let svc = await Service.create(opts);
  open.push(svc);
  let base = await svc.listen();
  const out: unknown[] = [];
  const note = async (r: Response) => out.push([r.status, r.status === 200 ? await r.json() : null]);
  // Groups of slime records (each packs to about 41 tokens: a step of two groups is two micro-batches).
  for (let g = 0; g < 12; g++) await note(await post(`${base}/buffer/write`, record(g, 0, g / 12)));
  // Gateway calls under a scoped key and under a header: one episode finished, one left open (one group).
  const key = ((await (await post(`${base}/v1/episodes`, { episode_id: 'agent-a', group: 'ga' })).json()) as { api_key: string }).api_key;
  for (let k = 0; k < 3; k++) {
    await note(
      await post(
        `${base}/v1/chat/completions`,
        { model: 'm', messages: [{ role: 'user', content: `a ${k}` }] },
        { authorization: `Bearer ${key}` },
      ),
    );
    await note(
      await post(
        `${base}/v1/chat/completions`,
        { model: 'm', messages: [{ role: 'user', content: `b ${k}` }] },
        { 'x-treepack-episode': 'agent-b', 'x-treepack-group': 'ga' },
      ),
    );
  }
  await note(await post(`${base}/v1/episodes/agent-a/finish`, { reward: 1 }));
  // The groups finish out of order; the trainer acknowledges all but one micro-batch.
  for (const g of [1, 0, 3, 2, 5, 4, 6, 8, 7]) {
    await note(await post(`${base}/buffer/write`, record(g, 1, 1 - g / 12)));
    const mb = await pull(base);
    out.push(mb ?? null);
    if (mb && g !== 3) await note(await post(`${base}/v1/batches/${mb.id}/ack`, {}));
  }
  await note(await post(`${base}/get_rollout_data`, { batch_size: 2 }));
  await note(await post(`${base}/v1/feed/flush`, {}));
  out.push(await observe(svc, base));

  // Restart from the log.
  await open.pop()!.close();
  svc = await Service.create(opts);
  open.push(svc);
  base = await svc.listen();
  out.push(await observe(svc, base));
  // Late duplicates are refused as before, the open episode goes on, the rest is handed out.
  await note(await post(`${base}/buffer/write`, record(0, 1, 0)));
  await note(await post(`${base}/buffer/write`, record(0, 2, 0)));
  await note(await post(`${base}/v1/episodes/agent-a/finish`, { reward: 0 }));
  await note(await post(`${base}/v1/batches/0.0/ack`, {}));
  await note(
    await post(
      `${base}/v1/chat/completions`,
      { model: 'm', messages: [{ role: 'user', content: 'b 3' }] },
      { 'x-treepack-episode': 'agent-b' },
    ),
  );
  await note(await post(`${base}/v1/episodes/agent-b/finish`, { reward: 0.5 }));
  for (let g = 9; g < 12; g++) await note(await post(`${base}/buffer/write`, record(g, 1, 0)));
  for (let mb = await pull(base, 1); mb; mb = await pull(base)) {
    out.push(mb);
    await note(await post(`${base}/v1/batches/${mb.id}/ack`, {}));
  }
  out.push(await observe(svc, base));
  // Once more from the log, compacted after the first restart.
  await open.pop()!.close();
  svc = await Service.create(opts);
  open.push(svc);
  base = await svc.listen();
  out.push(await observe(svc, base), (await fetch(`${base}/v1/batches/next`)).status);
  return {
    out,
    size: statSync(join(dataDir, 'events.jsonl')).size,
    first: readFileSync(join(dataDir, 'events.jsonl'), 'utf8').split('\n')[0],
  };
}

describe('log compaction', { timeout: 120_000 }, () => {
  it('a compacted log answers as the full one, before and after a restart', async () => {
    const full = await scenario(1 << 30);
    const compacted = await scenario(1);
    expect(JSON.parse(compacted.first).type).toBe('snapshot');
    expect(JSON.parse(full.first).type).not.toBe('snapshot');
    expect(compacted.size).toBeLessThan(full.size);
    // Call ids and times differ between runs; everything else must not.
    const clean = (v: unknown) =>
      JSON.parse(
        JSON.stringify(v, (k, x) =>
          k === 'id' && typeof x === 'string' && x.startsWith('chatcmpl') ? 'ID' : k === 'created' || k === 'time' ? 0 : x,
        ),
      );
    expect(clean(compacted.out)).toEqual(clean(full.out));
  });

  it('appends are answered while the compaction rewrites the log; the lines appended meanwhile follow its result', async () => {
    const path = join(tempDir('tp-compact-bg-'), 'events.jsonl');
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const asked: number[] = [];
    const marker = Buffer.from('{"type":"compacted"}\n');
    // A stand-in for compactEvents: the prefix as it was, after a marker line, once the test lets it finish.
    const rewrite = async (p: string, upto: number, tmp: string) => {
      asked.push(upto);
      await gate;
      writeFileSync(tmp, Buffer.concat([marker, readFileSync(p).subarray(0, upto)]));
      return marker.length + upto;
    };
    const log = await DurableLog.open(path, () => {}, { rewrite, compactBytes: 1 });
    await log.append({ type: 'a', n: 0 }); // the log passed compactBytes: the rewrite starts
    expect(asked).toEqual([statSync(path).size]);
    for (let n = 1; n <= 3; n++) await log.append({ type: 'a', n }); // answered while it waits
    expect(log.compactions).toBe(0);
    release();
    await log.append({ type: 'a', n: 4 });
    await log.close();
    expect(log.compactions).toBe(1);
    const seen: unknown[] = [];
    await (await DurableLog.open(path, (e) => seen.push(e))).close();
    expect(seen).toEqual([{ type: 'compacted' }, ...[0, 1, 2, 3, 4].map((n) => ({ type: 'a', n }))]);
  });

  for (const at of ['written', 'renamed'] as const) {
    it(`kill -9 inside a compaction (${at === 'written' ? 'before' : 'after'} the rename): nothing acknowledged lost or handed out again`, async () => {
      stub ??= await startStubEngine();
      const data = tempDir('tp-compact-kill-');
      // a micro-batch pulled and not acknowledged before the kill stays leased (the trainer may still ack it): 1 s
      const args = [
        '--engine',
        stub.url,
        '--data',
        data,
        '--tokenizer',
        'qwen3',
        '--group-size',
        '1',
        '--compact-bytes',
        '4000',
        '--lease',
        '1',
      ];
      let proc: ServeProcess = await startServeProcess(args, { TREEPACK_SERVE_COMPACT_FAULT: at });
      const written: string[] = [];
      const acked = new Map<string, string[]>();
      try {
        for (let g = 0; g < 200; g++) {
          const w = await post(`${proc.url}/buffer/write`, record(g, 0, 1)).catch(() => undefined);
          if (w?.status !== 200) break;
          written.push(`g${g}-e0`);
          if (g % 3 === 2) continue; // left for after the restart
          const mb = await pull(proc.url).catch(() => undefined);
          if (!mb) break;
          const a = await post(`${proc.url}/v1/batches/${mb.id}/ack`, {}).catch(() => undefined);
          if (a?.status !== 200) break;
          acked.set(mb.id, mb.seqIds);
        }
        if (proc.child.exitCode === null && proc.child.signalCode === null) await new Promise((r) => proc.child.once('exit', r));
        expect(proc.child.signalCode, 'the fault hook killed the service inside a compaction').toBe('SIGKILL');
        expect(written.length).toBeGreaterThan(10);
      } finally {
        await proc.kill9();
      }
      proc = await startServeProcess(args);
      try {
        expect(existsSync(join(data, 'events.jsonl.compact'))).toBe(false);
        const first = JSON.parse(readFileSync(join(data, 'events.jsonl'), 'utf8').split('\n')[0]) as { type: string };
        expect(first.type === 'snapshot').toBe(at === 'renamed');
        for (const uid of written) expect((await fetch(`${proc.url}/v1/episodes/${uid}`)).status, uid).toBe(200);
        for (let mb = await pull(proc.url, 2); mb; mb = await pull(proc.url, 2)) {
          expect(acked.has(mb.id), `acknowledged micro-batch ${mb.id} handed out again`).toBe(false);
          expect((await post(`${proc.url}/v1/batches/${mb.id}/ack`, {})).status).toBe(200);
          acked.set(mb.id, mb.seqIds);
        }
        // Every record written, in exactly one acknowledged micro-batch (a write answered after the kill may add one).
        const all = [...acked.values()].flat().sort();
        expect(new Set(all).size).toBe(all.length);
        expect(all.filter((s) => !written.includes(s)).length).toBeLessThanOrEqual(1);
        for (const uid of written) expect(all).toContain(uid);
      } finally {
        await proc.kill9();
      }
    });
  }
});
