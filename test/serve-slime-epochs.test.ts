/**
 * slime's epochs (D4): slime's producer writes every instance again each epoch (`num_epoch`, `num_repeats`) with
 * new uids, and its rollout buffer (slime_plugins/rollout_buffer/buffer.py) takes every write: a record joins its
 * instance's records not yet read, and a read takes (and forgets) each instance holding at least
 * `num_repeat_per_sample` of them. The service must take the same writes, in the in-process pool (across a
 * restart) and in the shared pool (records of one instance spread over two gateways), and read each record back
 * exactly once, as written, grouped by its instance. A resent write (slime tries twice) is answered and read once;
 * the same uid with another record is refused.
 */
import { afterEach, describe, expect, it } from 'vitest';
import type { ServiceOptions } from '../src/serve/service.js';
import { inProcessServices } from './helpers/in-process.js';
import { redisAvailable, startRedis, type RedisServer } from './helpers/redis.js';
import { tempDir } from './helpers/serve.js';

const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

type Rec = {
  uid: string;
  instance_id: number;
  messages: { role: string; content: string }[];
  reward: number;
  extra_info: Record<string, unknown>;
};
type Read = { success: boolean; data: { data: Rec[] } };

/** slime's producer: each epoch, each instance `n` times with fresh uids (as base_generator.py writes them). */
function epochs(instances: number, n: number, count: number): Rec[][] {
  return Array.from({ length: count }, (_, e) =>
    Array.from({ length: instances * n }, (_, i) => {
      const inst = Math.floor(i / n);
      return {
        uid: `e${e}-i${inst}-r${i % n}`,
        instance_id: inst,
        messages: [
          { role: 'user', content: `q${inst}` },
          { role: 'assistant', content: `epoch ${e} try ${i % n}` },
        ],
        reward: (i % n) / n,
        extra_info: { epoch: e },
      };
    }),
  );
}

/**
 * Writes the epochs through `bases` in turn, reading with get_rollout_data after every other epoch's first half
 * (so an instance's next epoch arrives before its group of the last one is read, and after it is); returns every
 * record read, by read.
 */
async function produceAndRead(bases: () => string[], all: Rec[][], between?: (epoch: number) => Promise<void>): Promise<Rec[][]> {
  const reads: Rec[][] = [];
  const read = async () => {
    for (;;) {
      const r = (await (await post(`${bases()[reads.length % bases().length]}/get_rollout_data`, {})).json()) as Read;
      if (!r.success) return;
      reads.push(r.data.data);
    }
  };
  let k = 0;
  const write = async (rec: Rec) => {
    const res = await post(`${bases()[k++ % bases().length]}/buffer/write`, rec);
    expect(res.status, await res.clone().text()).toBe(200); // slime's buffer takes every write
  };
  for (const [e, records] of all.entries()) {
    const half = records.length / 2;
    for (const rec of records.slice(0, half)) await write(rec);
    if (e % 2 === 1) await read();
    await between?.(e);
    for (const rec of records.slice(half)) await write(rec);
    // slime's producer tries a write twice when the first answer is lost: the resend is answered, not doubled
    await write(records[0]);
  }
  await read();
  return reads;
}

/** What slime's buffer guarantees: every record read once, as written; a read's records of one instance in whole groups. */
function checkReads(reads: Rec[][], all: Rec[][], n: number): void {
  const written = new Map(all.flat().map((r) => [r.uid, r]));
  const seen = reads.flat();
  expect(seen.map((r) => r.uid).sort()).toEqual([...written.keys()].sort());
  for (const r of seen) expect(r).toEqual({ ...written.get(r.uid), raw_reward: r.reward });
  for (const read of reads) {
    const per = new Map<number, number>();
    for (const r of read) per.set(r.instance_id, (per.get(r.instance_id) ?? 0) + 1);
    for (const [inst, count] of per) expect(count % n, `instance ${inst} in one read`).toBe(0);
  }
}

describe("slime's epochs: each instance written again every epoch, with new uids", { timeout: 60_000 }, () => {
  let redis: RedisServer | undefined;
  const services = inProcessServices('tp-epochs-');
  afterEach(async () => {
    await redis?.stop();
    redis = undefined;
  });
  const make = (opts: Partial<ServiceOptions>) => services.start(opts);

  it('in-process pool: three epochs taken and read once each, across a restart', async () => {
    const n = 2;
    const all = epochs(3, n, 3);
    const dir = tempDir('tp-epochs-');
    let cur = await make({ groupSize: n, dataDir: dir, policy: { kind: 'windowed-fifo', window: 64 } });
    const reads = await produceAndRead(
      () => [cur.base],
      all,
      async (e) => {
        if (e !== 1) return;
        // replayed from its log, the pool places later records in the same rounds the live one would
        await services.stop(cur.svc);
        cur = await make({ groupSize: n, dataDir: dir, policy: { kind: 'windowed-fifo', window: 64 } });
      },
    );
    checkReads(reads, all, n);
    // the same uid with another record is a conflict, named
    const other = await post(`${cur.base}/buffer/write`, { ...all[0][0], reward: 0.5 });
    expect(other.status).toBe(409);
    expect(await other.text()).toMatch(/uid \\"e0-i0-r0\\" was already written/);
    // the round separator is no character of an id a client chooses
    const nul = await post(`${cur.base}/buffer/write`, { ...all[0][0], uid: 'x', instance_id: 'a\u0000b' });
    expect(nul.status).toBe(400);
    expect(await nul.text()).toMatch(/field \\"instance_id\\" .*U\+0000/);
  });

  it.skipIf(!redisAvailable('serve-slime-epochs (shared pool)'))(
    "shared pool: an instance's records over two gateways, three epochs, each read once",
    async () => {
      redis = await startRedis();
      const n = 2;
      const all = epochs(3, n, 3);
      const a = await make({ groupSize: n, redis: redis.url, policy: { kind: 'windowed-fifo', window: 64 } });
      const b = await make({ groupSize: n, redis: redis.url, policy: { kind: 'windowed-fifo', window: 64 } });
      const reads = await produceAndRead(() => [a.base, b.base], all);
      checkReads(reads, all, n);
    },
  );
});
