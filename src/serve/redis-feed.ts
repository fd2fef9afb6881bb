/**
 * The trainer feed on the shared Redis pool: any service forms steps, any service hands micro-batches out, and
 * trainer ranks may pull from any of them.
 *
 * - Steps. Every service mirrors the scheduling policy (the same Collector as the in-process feed) from the
 *   shared state, read in one script: `front` (every group numbered below it is taken), `taken` (the groups
 *   taken above it) and the `groups` stream (finished groups, in completion order). To form step n a service
 *   takes the form lock (only to spare duplicate packing work), reads the state, asks the policy, reads the
 *   groups' episodes and packs them; one script then publishes the step only if no one published step n
 *   meanwhile (`nsteps`), appending its micro-batches to the per-rank streams `mb:{rank}`, freeing the groups'
 *   records, moving `front`/`taken` and trimming the `groups` stream up to its oldest entry not taken: no service
 *   needs a taken group's entry, so the stream holds the finished groups waiting and little more. A service that
 *   dies while packing published nothing: the next one forms the same step. The lock is a short lease that its
 *   holder renews while it forms, so one killed meanwhile holds the others up for a moment only. The episodes
 *   packed out of the step (quarantine.ts) are pushed to the `quarantine` list by the same script, so they are
 *   listed and counted once, whoever packs the step.
 * - Hand-out. Each rank's stream has the consumer group `trainers`: a micro-batch is handed out by XREADGROUP,
 *   and one pending longer than the lease (its trainer died or stalled) is handed out again by XAUTOCLAIM.
 * - Acknowledgement. One script XACKs and deletes the entry and counts the step down; the last acknowledgement
 *   advances the trainer version. Acknowledging again (a retry whose answer was lost) is answered as done, as SQS
 *   does; a micro-batch never handed out is refused.
 *
 * With Redis's append-only file fsync'd on every write (`--appendfsync always`), a Redis restart loses nothing
 * acknowledged, and no micro-batch acknowledged is handed out again.
 */
import { Collector } from '../pack/schedule.js';
import { killPoint } from './faults.js';
import {
  handoutEntry,
  oldestPolicy,
  PackerUnavailable,
  type Acked,
  type FeedOptions,
  type Handout,
  type PackedOut,
  type PackFn,
  type TrainerFeed,
} from './feed.js';
import type { Metrics } from './metrics.js';
import { groupName, Pool, PoolError, type Episode } from './pool.js';
import {
  QUARANTINE_FEED_LIST,
  QUARANTINE_LIST_MAX,
  summary,
  type Quarantined,
  type QuarantineEntry,
  type QuarantineSummary,
} from './quarantine.js';
import { GONE_TTL_S, PREFIX, type RedisPool } from './redis-pool.js';

const TRAINERS = 'trainers';
/** the form lock's lease, renewed every quarter of it while its holder forms a step */
const FORM_LEASE_MS = 2000;
/** groups-stream entries the publish script scans per read for the oldest group not taken */
const TRIM_SCAN = 64;

const SCRIPTS = {
  /**
   * ARGV: prefix, step n, group ids JSON, group seqs JSON, whole (1/0), the step's quarantine entries (a JSON list
   * of their JSON texts), then per micro-batch rank, id, entry JSON, bytes → 1 when published, 0 when step n exists
   * already.
   */
  tpPublish: `
local p, n = ARGV[1], tonumber(ARGV[2])
if tonumber(redis.call('GET', p .. 'nsteps') or '0') ~= n then return 0 end
redis.call('SET', p .. 'nsteps', n + 1)
for _, g in ipairs(cjson.decode(ARGV[3])) do
  for _, e in ipairs(redis.call('HKEYS', p .. 'eps:' .. g)) do redis.call('DEL', p .. 'ep:' .. e) end
  redis.call('DEL', p .. 'eps:' .. g, p .. 'order:' .. g, p .. 'done:' .. g, p .. 'act:' .. g, p .. 'res:' .. g)
  redis.call('HDEL', p .. 'seq', g)
  redis.call('SET', p .. 'gone:' .. g, 1, 'EX', ${GONE_TTL_S})
end
local front = tonumber(redis.call('GET', p .. 'front') or '0')
for _, s in ipairs(cjson.decode(ARGV[4])) do redis.call('SADD', p .. 'taken', s) end
while redis.call('SREM', p .. 'taken', front) == 1 do front = front + 1 end
redis.call('SET', p .. 'front', front)
local keep, from = nil, '-'
while not keep do
  local es = redis.call('XRANGE', p .. 'groups', from, '+', 'COUNT', ${TRIM_SCAN})
  for _, e in ipairs(es) do
    local s = tonumber(e[2][4])
    if s >= front and redis.call('SISMEMBER', p .. 'taken', s) == 0 then
      keep = e[1]
      break
    end
  end
  if #es < ${TRIM_SCAN} then break end
  from = '(' .. es[#es][1]
end
if keep then redis.call('XTRIM', p .. 'groups', 'MINID', keep) else redis.call('XTRIM', p .. 'groups', 'MAXLEN', 0) end
local dead = cjson.decode(ARGV[6])
for _, e in ipairs(dead) do redis.call('RPUSH', p .. 'quarantine', e) end
if #dead > 0 then
  redis.call('LTRIM', p .. 'quarantine', -${QUARANTINE_LIST_MAX}, -1)
  redis.call('INCRBY', p .. 'quarantined', #dead)
end
local count = (#ARGV - 6) / 4
for i = 0, count - 1 do
  local k = 7 + i * 4
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
   * 2: acknowledged before (its step done), 3: acknowledged before (its step not done), -1: unknown, -3: not handed
   * out. A done step keeps its count (`step:n`, left 0) for GONE_TTL_S, so a retried ack is known as one.
   */
  tpAck: `
local p, id = ARGV[1], ARGV[2]
local step, i = string.match(id, '^(%d+)%.(%d+)$')
local sk = p .. 'step:' .. step
local v = redis.call('HGET', p .. 'mb', id)
if not v then
  local left, count = unpack(redis.call('HMGET', sk, 'left', 'count'))
  if left == '0' and tonumber(i) < tonumber(count) then return {2, tonumber(redis.call('GET', p .. 'version') or '0')} end
  return {-1, 0}
end
if v == 'acked' then return {3, tonumber(redis.call('GET', p .. 'version') or '0')} end
local rank, sid = string.match(v, '^(%d+) (.+)$')
local key = p .. 'mb:' .. rank
if #redis.call('XPENDING', key, '${TRAINERS}', sid, sid, 1) == 0 then return {-3, 0} end
redis.call('XACK', key, '${TRAINERS}', sid)
redis.call('XDEL', key, sid)
redis.call('HSET', p .. 'mb', id, 'acked')
if redis.call('HINCRBY', sk, 'left', -1) > 0 then
  return {0, tonumber(redis.call('GET', p .. 'version') or '0')}
end
local count = tonumber(redis.call('HGET', sk, 'count'))
for j = 0, count - 1 do redis.call('HDEL', p .. 'mb', step .. '.' .. j) end
redis.call('EXPIRE', sk, ${GONE_TTL_S})
return {1, redis.call('INCR', p .. 'version')}
`,
  /**
   * ARGV: prefix → {steps published, front, taken above front, finished groups stream, groups numbered, flush bound}:
   * the policy's shared state, consistent because one script reads it.
   */
  tpState: `
local p = ARGV[1]
return {
  redis.call('GET', p .. 'nsteps') or '0',
  redis.call('GET', p .. 'front') or '0',
  redis.call('SMEMBERS', p .. 'taken'),
  redis.call('XRANGE', p .. 'groups', '-', '+'),
  redis.call('GET', p .. 'nseq') or '0',
  redis.call('GET', p .. 'flush-below') or '0',
}
`,
  /** ARGV: prefix → the flush bound, raised to the groups numbered so far */
  tpFlush: `
local p = ARGV[1]
local n = tonumber(redis.call('GET', p .. 'nseq') or '0')
if n > tonumber(redis.call('GET', p .. 'flush-below') or '0') then redis.call('SET', p .. 'flush-below', n) end
return redis.call('GET', p .. 'flush-below') or '0'
`,
  /** ARGV: prefix, token, lease ms → extends the forming lock's lease if this service still holds it */
  tpRenew: `
if redis.call('GET', ARGV[1] .. 'form-lock') == ARGV[2] then return redis.call('PEXPIRE', ARGV[1] .. 'form-lock', ARGV[3]) end
return 0
`,
  /** ARGV: prefix, token → releases the forming lock if this service still holds it */
  tpUnlock: `
if redis.call('GET', ARGV[1] .. 'form-lock') == ARGV[2] then return redis.call('DEL', ARGV[1] .. 'form-lock') end
return 0
`,
};

type StreamEntry<T = Buffer> = [id: T, fields: T[]];

function fields<T extends Buffer | string>(entry: StreamEntry<T>): Map<string, T> {
  const m = new Map<string, T>();
  const f = entry[1];
  for (let i = 0; i + 1 < f.length; i += 2) m.set(f[i].toString(), f[i + 1]);
  return m;
}

export class RedisFeed implements TrainerFeed {
  readonly errors: string[] = [];
  version = 0;
  /** the policy as last read from the shared state */
  private collector: Collector;
  /** group id by submission number, of the finished groups not taken */
  private groupIds = new Map<number, string>();
  /** keeps `version` current for the gateway's policy version even where no trainer pulls */
  private readonly versionTimer: NodeJS.Timeout;
  /** steps published, as last read */
  private steps = 0;

  private constructor(
    private readonly shared: RedisPool,
    private readonly opts: FeedOptions,
    private readonly pack: PackFn,
    private readonly metrics: Metrics,
    /** counts and logs entries newly quarantined */
    private readonly report: (entries: QuarantineEntry[]) => void,
  ) {
    this.collector = new Collector(opts.policy);
    shared.define(SCRIPTS);
    this.versionTimer = setInterval(() => void this.readVersion().catch(() => {}), 1000).unref();
  }

  private async readVersion(): Promise<void> {
    this.version = Number((await this.redis.get(`${PREFIX}version`)) ?? 0);
  }

  static async open(
    shared: RedisPool,
    opts: FeedOptions,
    pack: PackFn,
    metrics: Metrics,
    report: (entries: QuarantineEntry[]) => void,
  ): Promise<RedisFeed> {
    const feed = new RedisFeed(shared, opts, pack, metrics, report);
    for (let rank = 0; rank < opts.dp; rank++) {
      await shared.redis.xgroup('CREATE', `${PREFIX}mb:${rank}`, TRAINERS, '0', 'MKSTREAM').catch((err: Error) => {
        if (!err.message.startsWith('BUSYGROUP')) throw err;
      });
    }
    await feed.sync();
    return feed;
  }

  get head(): number {
    return this.collector.head;
  }

  private get redis() {
    return this.shared.redis;
  }

  /**
   * Rebuilds the mirrored policy from the shared state: every group below `front` and in `taken` is taken, every
   * group in the `groups` stream is finished (a taken group's entry may be trimmed, or not yet). Returns how many
   * groups are numbered and the flush bound (groups numbered below it may form smaller steps), as of the same
   * moment.
   */
  private async sync(): Promise<{ submitted: number; flushBelow: number }> {
    const [steps, front, taken, finished, submitted, flushBelow] = (await this.shared.script('tpState')) as [
      string,
      string,
      string[],
      StreamEntry<string>[],
      string,
      string,
    ];
    const collector = Collector.startingAt(this.opts.policy, Number(front));
    const groupIds = new Map<number, string>();
    for (const e of finished) {
      const f = fields(e);
      const seq = Number(f.get('seq'));
      if (seq < collector.head) continue;
      groupIds.set(seq, f.get('group')!);
      collector.complete(seq);
    }
    const takenSeqs = taken.map(Number);
    for (const seq of takenSeqs) if (!groupIds.has(seq)) collector.complete(seq);
    collector.takeGroups(takenSeqs);
    this.collector = collector;
    this.groupIds = groupIds;
    this.steps = Number(steps);
    return { submitted: Number(submitted), flushBelow: Number(flushBelow) };
  }

  /**
   * Forms the next step if the policy allows one now: `choose` picks its groups from the mirrored policy, and
   * `publish` turns their episodes into step n (undefined when another service published step n first: then
   * the step is chosen again). Undefined when no step formed.
   */
  private async form<T>(
    choose: (submitted: number, flushBelow: number) => number[],
    publish: (episodes: Episode[], n: number, seqs: number[]) => Promise<{ value: T } | undefined>,
  ): Promise<{ value: T } | undefined> {
    const token = Pool.newId();
    if ((await this.redis.set(`${PREFIX}form-lock`, token, 'PX', FORM_LEASE_MS, 'NX')) !== 'OK') return undefined;
    // Renewed while the event loop turns: packing that blocks it past the lease lets another service form the
    // same step meanwhile, which costs work only (the publish script takes one of the two).
    const renew = setInterval(() => void this.shared.script('tpRenew', token, FORM_LEASE_MS).catch(() => {}), FORM_LEASE_MS / 4);
    try {
      killPoint('TREEPACK_SERVE_FORM_FAULT', 'locked');
      for (;;) {
        const { submitted, flushBelow } = await this.sync();
        const seqs = choose(submitted, flushBelow);
        if (seqs.length === 0) return undefined;
        // an abandoned group's abandoned episodes count toward its size, and are not trained
        const episodes = (await Promise.all(seqs.map((s) => this.shared.groupEpisodes(this.groupIds.get(s)!))))
          .flat()
          .filter((ep) => ep.finished);
        const r = await publish(episodes, this.steps, seqs);
        if (r) return r;
      }
    } finally {
      clearInterval(renew);
      await this.shared.script('tpUnlock', token);
    }
  }

  private async publish(n: number, seqs: number[], whole: boolean, mbs: (string | number | Buffer)[], dead: QuarantineEntry[] = []) {
    const ids = seqs.map((s) => this.groupIds.get(s)!);
    const deadJson = JSON.stringify(dead.map((e) => JSON.stringify(e)));
    const args = [n, JSON.stringify(ids), JSON.stringify(seqs), whole ? 1 : 0, deadJson, ...mbs];
    const ok = Number(await this.shared.script('tpPublish', ...args)) === 1;
    if (ok) {
      this.collector.takeGroups(seqs);
      this.steps = n + 1;
    }
    return ok;
  }

  /** Packs a step and publishes its micro-batches; false when another service published step n first. */
  private async packStep(episodes: Episode[], n: number, seqs: number[]): Promise<{ value: true } | undefined> {
    const ids = seqs.map((s) => this.groupIds.get(s)!);
    const policyVersion = oldestPolicy(episodes, this.version);
    let packed: PackedOut[];
    let dead: Quarantined[] = [];
    try {
      ({ out: packed, quarantined: dead } = await this.pack(episodes));
    } catch (err) {
      if (err instanceof PackerUnavailable) throw err; // nothing published: this or another service forms it again
      // The same records fail the same way whoever packs them: the step is published empty, with the reason kept.
      this.errors.push(`step ${n} (groups ${ids.map((g) => JSON.stringify(g)).join(', ')}): ${(err as Error).message}`);
      this.metrics.rejected.inc({ reason: 'pack_error' });
      packed = [];
    }
    const mbs: (string | number | Buffer)[] = [];
    packed.forEach((out, i) => {
      const rank = out.entry.rank ?? i % this.opts.dp;
      const id = `${n}.${i}`;
      const entry = { packed: out.entry, id, step: n, rank, groups: ids.map(groupName), policyVersion };
      mbs.push(rank, id, JSON.stringify(entry), Buffer.from(out.bytes.buffer, out.bytes.byteOffset, out.bytes.byteLength));
    });
    // Published with the step, once: whoever packs step n quarantines the same episodes, one publication wins.
    const time = Date.now();
    const entries = dead.map((q) => ({ ...q, step: n, time }));
    if (!(await this.publish(n, seqs, false, mbs, entries))) return undefined;
    this.report(entries);
    this.metrics.microBatches.inc({ event: 'packed' }, packed.length);
    return { value: true };
  }

  next(rank: number, waitMs: number): Promise<Handout | undefined> {
    return this.shared.guard(this.nextOn(rank, waitMs));
  }

  private async nextOn(rank: number, waitMs: number): Promise<Handout | undefined> {
    const deadline = Date.now() + waitMs;
    for (;;) {
      const h = await this.claim(rank);
      if (h) return h;
      const formed = await this.form(
        (submitted, flushBelow) => this.collector.ready(this.opts.groupsPerStep, submitted, flushBelow),
        (eps, n, seqs) => this.packStep(eps, n, seqs),
      );
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
    const [, claimed] = (await this.redis.callBuffer('XAUTOCLAIM', key, TRAINERS, consumer, this.opts.leaseMs, '0-0', 'COUNT', 1)) as [
      Buffer,
      StreamEntry[],
    ];
    await this.readVersion();
    if (claimed.length > 0) return this.handOut(claimed[0], true);
    const r = (await this.redis.callBuffer('XREADGROUP', 'GROUP', TRAINERS, consumer, 'COUNT', 1, 'STREAMS', key, '>')) as
      [Buffer, StreamEntry[]][] | null;
    const fresh = r?.[0]?.[1]?.[0];
    return fresh ? this.handOut(fresh, false) : undefined;
  }

  private handOut(e: StreamEntry, reissued: boolean): Handout {
    const f = fields(e);
    const at = JSON.parse(f.get('entry')!.toString()) as {
      packed: Record<string, unknown>;
      id: string;
      step: number;
      rank: number;
      groups: string[];
      policyVersion: number;
    };
    const bytes = f.get('bytes')!;
    return {
      id: at.id,
      bytes: new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength),
      entry: handoutEntry(at.packed, at, this.version, this.opts.leaseMs, this.metrics, reissued),
    };
  }

  async ack(id: string): Promise<Acked> {
    const m = /^(\d+)\.(\d+)$/.exec(id);
    if (!m) throw new PoolError(404, `unknown micro-batch id ${JSON.stringify(id)}`);
    const [status, version] = (await this.shared.guard(this.shared.script('tpAck', id))) as number[];
    if (status === -1) throw new PoolError(404, `unknown micro-batch id ${JSON.stringify(id)}`);
    if (status === -3) throw new PoolError(409, `micro-batch ${id} was not handed out`);
    this.version = Math.max(this.version, version);
    const repeated = status === 2 || status === 3;
    if (!repeated) this.metrics.microBatches.inc({ event: 'acked' });
    return { step: Number(m[1]), stepDone: status === 1 || status === 2, trainerVersion: this.version, repeated };
  }

  async takeWhole<T>(max: number, read: (episodes: Episode[]) => T): Promise<T | undefined> {
    const r = await this.shared.guard(
      this.form(
        () => this.collector.peek(max),
        async (episodes, n, seqs) => {
          const value = read(episodes);
          return (await this.publish(n, seqs, true, [])) ? { value } : undefined;
        },
      ),
    );
    return r?.value;
  }

  /**
   * Shared, as the pool is: the groups numbered so far, through any gateway, may form smaller steps on every
   * service; groups numbered later wait for full steps again.
   */
  async flush(): Promise<number> {
    return Number(await this.shared.guard(this.shared.script('tpFlush')));
  }

  async quarantine(): Promise<{ count: number; latest: QuarantineSummary[] }> {
    const count = this.shared.guard(this.redis.get(`${PREFIX}quarantined`));
    const [n, latest] = await Promise.all([count, this.quarantined(QUARANTINE_FEED_LIST)]);
    return { count: Number(n ?? 0), latest: latest.map(summary) };
  }

  async quarantined(limit: number): Promise<QuarantineEntry[]> {
    const lines = await this.shared.guard(this.redis.lrange(`${PREFIX}quarantine`, -limit, -1));
    return lines.map((l) => JSON.parse(l) as QuarantineEntry);
  }

  /** Micro-batches waiting and leased, over every rank. */
  depth(): Promise<{ ready: number; leased: number }> {
    return this.shared.guard(this.depthOn());
  }

  private async depthOn(): Promise<{ ready: number; leased: number }> {
    let ready = 0,
      leased = 0;
    for (let rank = 0; rank < this.opts.dp; rank++) {
      const key = `${PREFIX}mb:${rank}`;
      const [len, pending] = await Promise.all([this.redis.xlen(key), this.redis.xpending(key, TRAINERS)]);
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
