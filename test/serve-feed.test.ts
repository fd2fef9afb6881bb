/**
 * The trainer feed and the slime rollout buffer on the live service: windowed FIFO never hands out a group
 * outside [head, head+W) and forms the same steps as the simulated collector under random completion times;
 * async takes completion order; leases re-hand-out unacknowledged micro-batches; dp ranks each get theirs;
 * slime's get_rollout_data answers whole groups in slime's format.
 */
import { describe, expect, it } from 'vitest';
import { parseSafetensors } from '../src/io/safetensors.js';
import { simulateCollector, type CollectorPolicy } from '../src/pack/schedule.js';
import type { ServiceOptions } from '../src/serve/service.js';
import { slimeRecord as record, tempDir } from './helpers/serve.js';
import { rng } from './helpers/sequences.js';
import { inProcessServices } from './helpers/in-process.js';

const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

interface Entry {
  id: string;
  groups: string[];
  rank: number;
  feed_step: number;
  staleness: number;
}

const services = inProcessServices('tp-feed-');

async function service(opts: Partial<ServiceOptions>): Promise<string> {
  return (await services.start({ groupSize: 2, ...opts })).base;
}

/** Pulls and acknowledges micro-batches for every rank until none is ready. */
async function drain(base: string, dp = 1): Promise<{ entry: Entry; seqIds: string[] }[]> {
  const got = [];
  for (let more = true; more;) {
    more = false;
    for (let rank = 0; rank < dp; rank++) {
      const res = await fetch(`${base}/v1/batches/next?rank=${rank}`);
      if (res.status === 204) continue;
      expect(res.status).toBe(200);
      const entry = JSON.parse(res.headers.get('x-treepack-entry')!) as Entry;
      const meta = parseSafetensors(new Uint8Array(await res.arrayBuffer())).metadata;
      got.push({ entry, seqIds: JSON.parse(meta.sequence_ids) as string[] });
      expect((await post(`${base}/v1/batches/${entry.id}/ack`, {})).status).toBe(200);
      more = true;
    }
  }
  return got;
}

async function runSchedule(policy: CollectorPolicy, seed: number, groups: number, groupsPerStep: number) {
  const base = await service({ policy, groupsPerStep });
  const r = rng(seed);
  // Submission: each group's first episode, in order; completion: the second episodes in random order.
  for (let g = 0; g < groups; g++) expect((await post(`${base}/buffer/write`, record(g, 0, r()))).status).toBe(200);
  const order = Array.from({ length: groups }, (_, g) => g).sort(() => r() - 0.5);
  const steps: number[][] = [];
  for (const g of order) {
    expect((await post(`${base}/buffer/write`, record(g, 1, r()))).status).toBe(200);
    for (const { entry, seqIds } of await drain(base)) {
      steps.push(entry.groups.map((id) => Number(id.slice(1))));
      // The micro-batch holds exactly its groups' episodes.
      expect(seqIds.sort()).toEqual(entry.groups.flatMap((id) => [`${id}-e0`, `${id}-e1`]).sort());
    }
  }
  // The producers are done: what is left forms smaller steps, as the simulated collector's last batches.
  await post(`${base}/v1/feed/flush`, {});
  for (const { entry } of await drain(base)) steps.push(entry.groups.map((id) => Number(id.slice(1))));
  const sim = simulateCollector(
    policy,
    order.map((_, g) => ({ submitted: 0, completed: order.indexOf(g) })),
    groupsPerStep,
  );
  return { steps, sim: sim.batches.map((b) => b.groups), order };
}

describe('trainer feed', { timeout: 120_000 }, () => {
  it('windowed FIFO: only groups inside [head, head+W), the same steps as the simulated collector', async () => {
    const W = 3;
    for (const seed of [1, 2]) {
      const { steps, sim } = await runSchedule({ kind: 'windowed-fifo', window: W }, seed, 10, 2);
      expect(steps).toEqual(sim);
      const taken = new Set<number>();
      for (const step of steps) {
        let head = 0;
        while (taken.has(head)) head++;
        for (const g of step) expect(g >= head && g < head + W, `group ${g} outside [${head}, ${head + W})`).toBe(true);
        for (const g of step) taken.add(g);
      }
      expect(taken.size).toBe(10);
    }
  });

  it('async: completion order; strict FIFO (window 1): submission order', async () => {
    const a = await runSchedule({ kind: 'async' }, 3, 6, 1);
    expect(a.steps.flat()).toEqual(a.order);
    const f = await runSchedule({ kind: 'windowed-fifo', window: 1 }, 4, 6, 1);
    expect(f.steps.flat()).toEqual([0, 1, 2, 3, 4, 5]);
  });

  it('re-hands out a micro-batch not acknowledged within the lease; an ack is once', async () => {
    const base = await service({ leaseMs: 300, groupSize: 1 });
    await post(`${base}/buffer/write`, record(0, 0, 1));
    const first = await fetch(`${base}/v1/batches/next`);
    const id = first.headers.get('x-treepack-id')!;
    expect((await fetch(`${base}/v1/batches/next`)).status).toBe(204); // leased: not handed out twice
    const again = await fetch(`${base}/v1/batches/next?wait=5`);
    expect(again.headers.get('x-treepack-id')).toBe(id); // the trainer died: after the lease, again
    expect(Buffer.from(await again.arrayBuffer()).equals(Buffer.from(await first.arrayBuffer()))).toBe(true);
    expect((await post(`${base}/v1/batches/${id}/ack`, {})).status).toBe(200);
    const twice = await post(`${base}/v1/batches/${id}/ack`, {});
    expect(twice.status).toBe(200); // acknowledged before: answered, nothing changes
    expect(await twice.json()).toMatchObject({ repeated: true });
    const metrics = await (await fetch(`${base}/metrics`)).text();
    expect(metrics).toMatch(/treepack_micro_batches_total\{event="reissued"\} 1/);
  });

  it('a flush is logged and bounded: after a restart the smaller step it allowed still forms, later groups wait for full steps', async () => {
    const dataDir = tempDir('tp-feed-flush-');
    const { base, svc } = await services.start({ dataDir, groupSize: 1, groupsPerStep: 2 });
    expect((await post(`${base}/buffer/write`, record(0, 0, 1))).status).toBe(200);
    expect((await fetch(`${base}/v1/batches/next`)).status).toBe(204); // one group of a two-group step
    const flushed = await post(`${base}/v1/feed/flush`, {});
    expect(await flushed.json()).toEqual({ flushing: true, flush_below: 1 });
    await services.stop(svc);
    const again = await service({ dataDir, groupSize: 1, groupsPerStep: 2 });
    const [got] = await drain(again);
    expect(got?.entry.groups).toEqual(['g0']);
    expect(got?.seqIds).toEqual(['g0-e0']);
    // The flush covered the groups numbered before it: a new rollout's groups form full steps again.
    expect((await post(`${again}/buffer/write`, record(1, 0, 1))).status).toBe(200);
    expect((await fetch(`${again}/v1/batches/next`)).status).toBe(204);
    expect((await post(`${again}/buffer/write`, record(2, 0, 1))).status).toBe(200);
    expect((await drain(again)).map((x) => x.entry.groups)).toEqual([['g1', 'g2']]);
  });

  it('dp ranks: every rank gets its own micro-batches of each step, balanced by the packer', async () => {
    const base = await service({ dp: 2, groupSize: 2, groupsPerStep: 2, packer: { budget: { maxTokens: 64, dp: 2 } } });
    for (let g = 0; g < 2; g++) for (let k = 0; k < 2; k++) await post(`${base}/buffer/write`, record(g, k, k));
    const got = await drain(base, 2);
    expect(got.length % 2).toBe(0);
    expect(new Set(got.map((x) => x.entry.rank))).toEqual(new Set([0, 1]));
    expect(got.flatMap((x) => x.seqIds).sort()).toEqual(['g0-e0', 'g0-e1', 'g1-e0', 'g1-e1']);
    expect((await fetch(`${base}/v1/batches/next?rank=2`)).status).toBe(400);
  });

  it("step plans: a rank's micro-batches go to one client in plan order; after the lease the run starts over from its first", async () => {
    const opts = {
      groupSize: 4,
      leaseMs: 4000,
      dataDir: tempDir('tp-feed-plan-'),
      packer: { budget: { maxTokens: 40, prefixCacheTokens: 4096, dp: 1 } },
    };
    const first0 = await services.start(opts);
    let base = first0.base;
    // Four episodes of one task under a long shared system prompt: the plan pushes the trunk, then its branches hang from it.
    const system = Array.from({ length: 40 }, (_, i) => `rule ${i}`).join('; ');
    for (let k = 0; k < 4; k++) {
      const rec = record(0, k, k);
      rec.messages[0].content = system;
      rec.messages[2].content = `answer ${k}: ${`step ${k} `.repeat(8)}`;
      expect((await post(`${base}/buffer/write`, rec)).status).toBe(200);
    }
    const next = async (client: string) => {
      const res = await fetch(`${base}/v1/batches/next?rank=0&client=${client}`);
      if (res.status === 204) return undefined;
      expect(res.status).toBe(200);
      return JSON.parse(res.headers.get('x-treepack-entry')!) as Entry & { step: number; prefix_push: number[]; prefix_tokens: number };
    };
    const first = (await next('a'))!;
    expect(first.prefix_push.length).toBeGreaterThan(0); // it pushes the trunk the others hang from
    expect(await next('b')).toBeUndefined(); // client a holds the run: b would lack the pushed prefix
    const second = (await next('a'))!;
    expect(second.step).toBe(first.step + 1);
    expect(second.prefix_tokens).toBeGreaterThan(0);
    // The service restarts: the log replays which client holds the run.
    await services.stop(first0.svc);
    base = (await services.start(opts)).base;
    expect(await next('b')).toBeUndefined();
    expect((await next('a'))!.step).toBe(first.step + 2);
    await new Promise((r) => setTimeout(r, 4100)); // a dies: its lease runs out (long enough for the restart above on a loaded machine)
    const again: (Entry & { step: number })[] = [];
    for (let e = await next('b'); e; e = await next('b')) again.push(e);
    expect(again[0].id).toBe(first.id); // the run starts over from its first micro-batch, in plan order
    expect(again.map((e) => e.step)).toEqual(again.map((_, i) => first.step + i));
    expect(again.length).toBeGreaterThan(2);
    expect(await next('a')).toBeUndefined(); // a, back, gets nothing of b's run
    for (const e of again) expect((await post(`${base}/v1/batches/${e.id}/ack`, {})).status).toBe(200);
    expect((await fetch(`${base}/v1/batches/next?rank=0&client=%20`)).status).toBe(400);
  });

  it('long poll: a trainer waiting is answered when the group finishes', async () => {
    const base = await service({ groupSize: 1 });
    const waiting = fetch(`${base}/v1/batches/next?wait=20`);
    await new Promise((r) => setTimeout(r, 200));
    await post(`${base}/buffer/write`, record(7, 0, 1));
    const res = await waiting;
    expect(res.status).toBe(200);
    expect((JSON.parse(res.headers.get('x-treepack-entry')!) as Entry).groups).toEqual(['g7']);
  });
});

describe('slime rollout buffer', { timeout: 60_000 }, () => {
  it("start_rollout, buffer/write, get_rollout_data: whole groups in slime's format", async () => {
    const base = await service({ groupSize: 1 });
    const start = await post(`${base}/start_rollout`, {
      num_process: '100',
      num_epoch: '3',
      remote_engine_url: 'http://127.0.0.1:30000',
      remote_buffer_url: base,
      task_type: 'math',
      input_file: 'x.jsonl',
      num_repeat_per_sample: '2',
      max_tokens: '1024',
      sampling_params: { max_tokens: 1024, temperature: 0.8, top_p: 1 },
      tokenizer_path: '/m',
      skip_instance_ids: [],
    });
    expect(await start.json()).toEqual({ message: 'Rollout started' });
    const w = await post(`${base}/buffer/write`, record(0, 0, 1));
    expect(await w.json()).toMatchObject({ success: true, data: { data: [{ uid: 'g0-e0' }], meta_info: 'write to buffer' } });
    await post(`${base}/buffer/write`, record(1, 0, 0.5));
    await post(`${base}/buffer/write`, record(0, 1, 0));
    const got = (await (await post(`${base}/get_rollout_data`, {})).json()) as {
      success: boolean;
      data: { data: Record<string, unknown>[]; meta_info: Record<string, unknown> };
    };
    expect(got.success).toBe(true);
    expect(got.data.data.map((r) => r.uid)).toEqual(['g0-e0', 'g0-e1']); // g1 is not whole yet
    for (const r of got.data.data)
      for (const k of ['uid', 'instance_id', 'messages', 'reward', 'raw_reward', 'extra_info']) expect(r).toHaveProperty(k);
    expect(got.data.meta_info).toMatchObject({ total_samples: 2, num_groups: 1, avg_group_size: 2, avg_reward: 0.5, finished_groups: [] });
    const none = (await (await post(`${base}/get_rollout_data`, {})).json()) as { success: boolean; message: string };
    expect(none).toMatchObject({ success: false, message: 'No data available to read' });
    await post(`${base}/buffer/write`, record(1, 1, 0));
    const second = (await (await post(`${base}/get_rollout_data`, { batch_size: 2 })).json()) as {
      data: { data: { instance_id: string }[] };
    };
    expect(second.data.data.map((r) => r.instance_id)).toEqual(['g1', 'g1']);
  });

  it('records read back as written: integer ids stay integers', async () => {
    const base = await service({ groupSize: 1 });
    const messages = [
      { role: 'user', content: 'q' },
      { role: 'assistant', content: 'a' },
    ];
    const w = await post(`${base}/buffer/write`, { uid: 7, instance_id: 0, messages, reward: 1, extra_info: { index: 0 } });
    expect(w.status).toBe(200);
    const got = (await (await post(`${base}/get_rollout_data`, {})).json()) as { data: { data: Record<string, unknown>[] } };
    expect(got.data.data).toEqual([{ uid: 7, instance_id: 0, messages, reward: 1, raw_reward: 1, extra_info: { index: 0 } }]);
  });

  it('a gateway episode with a tool-calling turn reads back with content "" where the client sent null', async () => {
    const base = await service({ groupSize: 1 });
    const toolTurn = {
      role: 'assistant',
      content: null,
      tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } }],
    };
    const messages = [{ role: 'user', content: 'go' }, toolTurn, { role: 'tool', tool_call_id: 'c1', content: 'done' }];
    expect((await post(`${base}/episodes/t1/v1/chat/completions`, { model: 'm', messages })).status).toBe(200);
    expect((await post(`${base}/v1/episodes/t1/finish`, { reward: 1 })).status).toBe(200);
    const got = (await (await post(`${base}/get_rollout_data`, {})).json()) as {
      data: { data: { messages: { role: string; content: unknown }[] }[] };
    };
    const read = got.data.data[0].messages;
    expect(read.map((m) => m.role)).toEqual(['user', 'assistant', 'tool', 'assistant']);
    expect(read.every((m) => typeof m.content === 'string')).toBe(true);
    expect(read[1]).toMatchObject({ content: '', tool_calls: toolTurn.tool_calls });
  });
});
