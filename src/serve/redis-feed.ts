/**
 * The trainer feed on the shared Redis pool: any service forms steps, any service hands micro-batches out, and
 * trainer ranks may pull from any of them.
 *
 * - Steps. Every service mirrors the scheduling policy (the same Collector as the in-process feed) by tailing
 *   the `groups` stream (finished groups) and the `steps` stream (steps taken). To form step n a service takes
 *   a short lock (only to spare duplicate packing work), catches up, asks the policy, reads the groups' episodes
 *   and packs them; one script then publishes the step only if no one published step n meanwhile (`nsteps`),
 *   appending its micro-batches to the per-rank streams `mb:{rank}` and freeing the groups' records. A service
 *   that dies while packing published nothing: the next one forms the same step.
 * - Hand-out. Each rank's stream has the consumer group `trainers`: a micro-batch is handed out by XREADGROUP,
 *   and one pending longer than the lease (its trainer died or stalled) is handed out again by XAUTOCLAIM.
 * - Acknowledgement. One script XACKs and deletes the entry and counts the step down; the last acknowledgement
 *   advances the trainer version. Acknowledging twice, or a micro-batch never handed out, is refused.
 *
 * With Redis's append-only file fsync'd on every write (`--appendfsync always`), a Redis restart loses nothing
 * acknowledged, and no micro-batch acknowledged is handed out again.
 */
import { randomBytes } from 'node:crypto';
import { Collector } from '../pack/schedule.js';
import { handoutEntry, oldestPolicy, type FeedOptions, type Handout, type PackFn, type TrainerFeed } from './feed.js';
import type { Metrics } from './metrics.js';
import { PoolError, type Episode } from './pool.js';
import { GONE_TTL_S, PREFIX, type RedisPool } from './redis-pool.js';

const TRAINERS = 'trainers';
const LOCK_MS = 30_000;

const SCRIPTS = {
  /**
   * ARGV: prefix, step n, group ids JSON, group seqs JSON, whole (1/0), then per micro-batch rank, id, entry JSON,
   * bytes → 1 when published, 0 when step n exists already.
   */
  tpPublish: `
local p, n = ARGV[1], tonumber(ARGV[2])
if tonumber(redis.call('GET', p .. 'nsteps') or '0') ~= n then return 0 end
redis.call('SET', p .. 'nsteps', n + 1)
redis.call('XADD', p .. 'steps', '*', 'n', n, 'seqs', ARGV[4], 'whole', ARGV[5])
for _, g in ipairs(cjson.decode(ARGV[3])) do
  redis.call('DEL', p .. 'eps:' .. g, p .. 'order:' .. g)
  redis.call('HDEL', p .. 'seq', g)
  redis.call('SET', p .. 'gone:' .. g, 1, 'EX', ${GONE_TTL_S})
end
local count = (#ARGV - 5) / 4
for i = 0, count - 1 do
  local k = 6 + i * 4
  local sid = redis.call('XADD', p .. 'mb:' .. ARGV[k], '*', 'id', ARGV[k + 1], 'entry', ARGV[k + 2], 'bytes', ARGV[k + 3])
  redis.call('HSET', p .. 'mb', ARGV[k + 1], ARGV[k] .. ' ' .. sid)
end
if count > 0 then
  redis.call('HSET', p .. 'step:' .. n, 'left', count, 'count', count)
elseif ARGV[5] == '0' then
  redis.call('INCR', p .. 'version')
end
return 1
`,
  /**
   * ARGV: prefix, micro-batch id → {status, trainer version}; status 1: the step is done, 0: acknowledged,
   * -1: unknown, -2: acknowledged before, -3: not handed out.
   */
  tpAck: `
local p, id = ARGV[1], ARGV[2]
local v = redis.call('HGET', p .. 'mb', id)
if not v then return {-1, 0} end
if v == 'acked' then return {-2, 0} end
local rank, sid = string.match(v, '^(%d+) (.+)$')
local key = p .. 'mb:' .. rank
if #redis.call('XPENDING', key, '${TRAINERS}', sid, sid, 1) == 0 then return {-3, 0} end
redis.call('XACK', key, '${TRAINERS}', sid)
redis.call('XDEL', key, sid)
redis.call('HSET', p .. 'mb', id, 'acked')
local step = string.match(id, '^(%d+)%.')
local sk = p .. 'step:' .. step
if redis.call('HINCRBY', sk, 'left', -1) > 0 then
  return {0, tonumber(redis.call('GET', p .. 'version') or '0')}
end
local count = tonumber(redis.call('HGET', sk, 'count'))
for i = 0, count - 1 do redis.call('HDEL', p .. 'mb', step .. '.' .. i) end
redis.call('DEL', sk)
return {1, redis.call('INCR', p .. 'version')}
`,
  /** ARGV: prefix, token → releases the forming lock if this service still holds it */
  tpUnlock: `
if redis.call('GET', ARGV[1] .. 'form-lock') == ARGV[2] then return redis.call('DEL', ARGV[1] .. 'form-lock') end
return 0
`,
};

type StreamEntry = [id: Buffer, fields: Buffer[]];

function fields(entry: StreamEntry): Map<string, Buffer> {
  const m = new Map<string, Buffer>();
  const f = entry[1];
  for (let i = 0; i + 1 < f.length; i += 2) m.set(f[i]!.toString(), f[i + 1]!);
  return m;
}

export class RedisFeed implements TrainerFeed {
  readonly collector: Collector;
  readonly errors: string[] = [];
  version = 0;
  /** group id by submission number, from the `groups` stream */
  private readonly groupIds = new Map<number, string>();
  /** keeps `version` current for the gateway's policy version even where no trainer pulls */
  private readonly versionTimer: NodeJS.Timeout;
  private steps = 0;
  private lastGroup = '0-0';
  private lastStep = '0-0';

  private constructor(
    private readonly shared: RedisPool,
    private readonly opts: FeedOptions,
    private readonly pack: PackFn,
    private readonly metrics: Metrics,
  ) {
    this.collector = new Collector(opts.policy);
    shared.define(SCRIPTS);
    this.versionTimer = setInterval(() => void this.readVersion().catch(() => {}), 1000).unref();
  }

  private async readVersion(): Promise<void> {
    this.version = Number((await this.redis.get(`${PREFIX}version`)) ?? 0);
  }

  static async open(shared: RedisPool, opts: FeedOptions, pack: PackFn, metrics: Metrics): Promise<RedisFeed> {
    const feed = new RedisFeed(shared, opts, pack, metrics);
    for (let rank = 0; rank < opts.dp; rank++) {
      await shared.redis.xgroup('CREATE', `${PREFIX}mb:${rank}`, TRAINERS, '0', 'MKSTREAM').catch((err: Error) => {
        if (!err.message.startsWith('BUSYGROUP')) throw err;
      });
    }
    await feed.catchUp();
    return feed;
  }

  get head(): number {
    return this.collector.head;
  }

  private get redis() {
    return this.shared.redis;
  }

  /**
   * Applies the steps taken and the groups finished since the last call. Steps are read first: every group a
   * step took was finished before the step was published, so the groups read next include them all.
   */
  private async catchUp(): Promise<void> {
    const steps = await this.readStream('steps', this.lastStep);
    const groups = await this.readStream('groups', this.lastGroup);
    for (const e of groups) {
      const f = fields(e);
      const seq = Number(f.get('seq')!.toString());
      this.groupIds.set(seq, f.get('group')!.toString());
      this.collector.complete(seq);
      this.lastGroup = e[0].toString();
    }
    for (const e of steps) {
      this.collector.takeGroups(JSON.parse(fields(e).get('seqs')!.toString()) as number[]);
      this.steps++;
      this.lastStep = e[0].toString();
    }
  }

  private async readStream(name: string, after: string): Promise<StreamEntry[]> {
    const r = (await this.redis.callBuffer('XREAD', 'COUNT', 100_000, 'STREAMS', PREFIX + name, after)) as [Buffer, StreamEntry[]][] | null;
    return r?.[0]?.[1] ?? [];
  }

  /**
   * Forms the next step if the policy allows one now: `choose` picks its groups from the mirrored policy, and
   * `publish` turns their episodes into step n (undefined when another service published step n first: then
   * the step is chosen again). Undefined when no step formed.
   */
  private async form<T>(choose: (submitted: number, flushing: boolean) => number[], publish: (episodes: Episode[], n: number, seqs: number[]) => Promise<{ value: T } | undefined>): Promise<{ value: T } | undefined> {
    const token = randomBytes(12).toString('base64url');
    if ((await this.redis.set(`${PREFIX}form-lock`, token, 'PX', LOCK_MS, 'NX')) !== 'OK') return undefined;
    try {
      for (;;) {
        await this.catchUp();
        const [submitted, flushing] = await Promise.all([this.redis.get(`${PREFIX}nseq`), this.redis.exists(`${PREFIX}flushing`)]);
        const seqs = choose(Number(submitted ?? 0), flushing === 1);
        if (seqs.length === 0) return undefined;
        const episodes = (await Promise.all(seqs.map((s) => this.shared.groupEpisodes(this.groupIds.get(s)!)))).flat();
        const r = await publish(episodes, this.steps, seqs);
        if (r) return r;
      }
    } finally {
      await this.shared.script('tpUnlock', token);
    }
  }

  private async publish(n: number, seqs: number[], whole: boolean, mbs: (string | number | Buffer)[]): Promise<boolean> {
    const ids = seqs.map((s) => this.groupIds.get(s)!);
    const ok = Number(await this.shared.script('tpPublish', n, JSON.stringify(ids), JSON.stringify(seqs), whole ? 1 : 0, ...mbs)) === 1;
    await this.catchUp();
    return ok;
  }

  /** Packs a step and publishes its micro-batches; false when another service published step n first. */
  private async packStep(episodes: Episode[], n: number, seqs: number[]): Promise<{ value: true } | undefined> {
    const ids = seqs.map((s) => this.groupIds.get(s)!);
    const policyVersion = oldestPolicy(episodes, this.version);
    let packed: Awaited<ReturnType<PackFn>>;
    try {
      packed = await this.pack(episodes);
    } catch (err) {
      // The same records fail the same way whoever packs them: the step is published empty, with the reason kept.
      this.errors.push(`step ${n} (groups ${ids.map((g) => JSON.stringify(g)).join(', ')}): ${(err as Error).message}`);
      this.metrics.rejected.inc({ reason: 'pack_error' });
      packed = [];
    }
    const mbs: (string | number | Buffer)[] = [];
    packed.forEach((out, i) => {
      const rank = out.entry.rank ?? i % this.opts.dp;
      const id = `${n}.${i}`;
      const entry = { packed: out.entry, id, step: n, rank, groups: ids, policyVersion };
      mbs.push(rank, id, JSON.stringify(entry), Buffer.from(out.bytes.buffer, out.bytes.byteOffset, out.bytes.byteLength));
    });
    if (!(await this.publish(n, seqs, false, mbs))) return undefined;
    this.metrics.microBatches.inc({ event: 'packed' }, packed.length);
    return { value: true };
  }

  async next(rank: number, waitMs: number): Promise<Handout | undefined> {
    const deadline = Date.now() + waitMs;
    for (;;) {
      const h = await this.claim(rank);
      if (h) return h;
      const formed = await this.form((submitted, flushing) => this.collector.ready(this.opts.groupsPerStep, submitted, flushing), (eps, n, seqs) => this.packStep(eps, n, seqs));
      if (formed) continue;
      const left = deadline - Date.now();
      if (left <= 0) return undefined;
      // Other services finish groups and publish steps: poll, as leases expire on their own clock too.
      await new Promise((r) => setTimeout(r, Math.min(left, 100)));
    }
  }

  /** A micro-batch whose lease ran out (its trainer died), else a new one; the rank's consumer owns it. */
  private async claim(rank: number): Promise<Handout | undefined> {
    const key = `${PREFIX}mb:${rank}`;
    const consumer = `rank-${rank}`;
    const [, claimed] = (await this.redis.callBuffer('XAUTOCLAIM', key, TRAINERS, consumer, this.opts.leaseMs, '0-0', 'COUNT', 1)) as [Buffer, StreamEntry[]];
    await this.readVersion();
    if (claimed.length > 0) return this.handOut(claimed[0]!, true);
    const r = (await this.redis.callBuffer('XREADGROUP', 'GROUP', TRAINERS, consumer, 'COUNT', 1, 'STREAMS', key, '>')) as [Buffer, StreamEntry[]][] | null;
    const fresh = r?.[0]?.[1]?.[0];
    return fresh ? this.handOut(fresh, false) : undefined;
  }

  private handOut(e: StreamEntry, reissued: boolean): Handout {
    const f = fields(e);
    const at = JSON.parse(f.get('entry')!.toString()) as { packed: Record<string, unknown>; id: string; step: number; rank: number; groups: string[]; policyVersion: number };
    const bytes = f.get('bytes')!;
    return { id: at.id, bytes: new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength), entry: handoutEntry(at.packed, at, this.version, this.opts.leaseMs, this.metrics, reissued) };
  }

  async ack(id: string): Promise<{ step: number; stepDone: boolean; trainerVersion: number }> {
    const m = /^(\d+)\.(\d+)$/.exec(id);
    if (!m) throw new PoolError(404, `unknown micro-batch id ${JSON.stringify(id)}`);
    const [status, version] = (await this.shared.script('tpAck', id)) as number[];
    if (status === -1) throw new PoolError(404, `unknown micro-batch id ${JSON.stringify(id)} (or its step is done)`);
    if (status === -2) throw new PoolError(409, `micro-batch ${id} is already acknowledged`);
    if (status === -3) throw new PoolError(409, `micro-batch ${id} was not handed out`);
    this.version = version!;
    this.metrics.microBatches.inc({ event: 'acked' });
    return { step: Number(m[1]), stepDone: status === 1, trainerVersion: this.version };
  }

  async takeWhole<T>(max: number, read: (episodes: Episode[]) => T): Promise<T | undefined> {
    const r = await this.form(
      () => this.collector.peek(max),
      async (episodes, n, seqs) => {
        const value = read(episodes);
        return (await this.publish(n, seqs, true, [])) ? { value } : undefined;
      },
    );
    return r?.value;
  }

  /** Shared: every service's steps may then be smaller than groupsPerStep. */
  async flush(): Promise<void> {
    await this.redis.set(`${PREFIX}flushing`, '1');
  }

  /** Micro-batches waiting and leased, over every rank. */
  async depth(): Promise<{ ready: number; leased: number }> {
    let ready = 0, leased = 0;
    for (let rank = 0; rank < this.opts.dp; rank++) {
      const key = `${PREFIX}mb:${rank}`;
      const [len, pending] = await Promise.all([this.redis.xlen(key), this.redis.xpending(key, TRAINERS) as Promise<unknown[]>]);
      const p = Number(pending[0] ?? 0);
      leased += p;
      ready += len - p;
    }
    return { ready, leased };
  }

  async close(): Promise<void> {
    clearInterval(this.versionTimer);
    await this.shared.close();
  }
}
