/**
 * The trainer feed: finished groups, taken by the scheduling policy (windowed FIFO, strict FIFO = a window of
 * one, or fully async; Collector in src/pack/schedule.ts), become a step; a step's records are packed into
 * micro-batches (rank and dp aware when the packer has a budget), handed out per rank, and acknowledged by the
 * trainer after its optimizer step. A micro-batch handed out and not acknowledged within the lease is handed out
 * again. Every decision that a client is told about is logged before it is told (`take` before the step's first
 * hand-out, `handout` with its lease's end before the micro-batch goes out, `ack` before the answer), so a
 * replayed service re-forms the same steps, re-packs them identically (packing is a pure function of its input),
 * accepts the acknowledgement of a micro-batch handed out before the crash, and hands out again exactly the
 * micro-batches neither acknowledged nor leased.
 */
import { Collector, type CollectorPolicy } from '../pack/schedule.js';
import { snapshotFlushBelow } from './compact.js';
import type { LogEvent } from './log.js';
import type { Metrics } from './metrics.js';
import { groupName, PoolError, type Episode, type Pool, type SnapshotEvent } from './pool.js';
import type { Quarantined, QuarantineEntry, QuarantineFile, QuarantineSummary } from './quarantine.js';

export interface PackedOut {
  bytes: Uint8Array;
  /** the packer's manifest entry: file, sequences, tokens, and rank/step with a budget */
  entry: Record<string, unknown> & { rank?: number };
}

/**
 * Packs the finished episodes of one step's groups, in group order, without the episodes whose records fail
 * (`quarantined`). Rejects with PackerUnavailable when the packer itself failed (not the records), any other
 * error being the records' fault.
 */
export type PackFn = (episodes: Episode[]) => Promise<{ out: PackedOut[]; quarantined: Quarantined[] }>;

/** The packer failed for a reason not in the records (its thread died): the step is packed again later, not dropped. */
export class PackerUnavailable extends PoolError {
  constructor(why: string) {
    super(503, `the packing thread failed (${why}); the step is packed again at the next request`);
  }
}

/** How the trainer feed forms and hands out steps: policy, groups per step, ranks, lease. */
export interface FeedOptions {
  policy: CollectorPolicy;
  /** groups per step: a step is formed only when this many are takeable */
  groupsPerStep: number;
  /** trainer ranks pulling micro-batches */
  dp: number;
  leaseMs: number;
}

interface MicroBatchSlot {
  id: string;
  step: number;
  rank: number;
  out: PackedOut;
  leasedUntil: number; // 0: never handed out
  /** the client its last hand-out went to (FeedClient's `client` id; undefined: one that named none) */
  client?: string;
  acked: boolean;
  minVersion: number;
}

interface Step {
  n: number;
  groups: number[];
  /** the `take` event's log write: nothing of the step is handed out before it is durable */
  logged: Promise<void>;
  packing?: Promise<void>;
  slots?: MicroBatchSlot[];
  acked: Set<string>; // ids acknowledged (known before packing on replay)
  /** lease ends (ms time) and clients of the micro-batches handed out, by id (known before packing on replay) */
  leases: Map<string, { until: number; client?: string }>;
  done: boolean;
  /** restored done from a compacted log, which keeps no micro-batch ids */
  compacted?: true;
}

/** A micro-batch handed to a trainer: its id (for the ack), its file bytes and its manifest entry. */
export interface Handout {
  id: string;
  bytes: Uint8Array;
  entry: Record<string, unknown>;
}

/** The answer to an acknowledgement: the micro-batch's step, whether it is done, and the trainer version. */
export interface Acked {
  step: number;
  stepDone: boolean;
  trainerVersion: number;
  /** acknowledged before: this acknowledgement changed nothing */
  repeated: boolean;
}

/** What the HTTP routes need of a trainer feed: the in-process Feed, or RedisFeed shared by many services. */
export interface TrainerFeed {
  /** completed steps: the trainer's policy version (as last seen, for a shared feed) */
  readonly version: number;
  /** the oldest group not taken yet */
  readonly head: number;
  /** steps whose records could not be packed, and why */
  readonly errors: string[];
  /** the episodes packed out of their steps (quarantine.ts): how many, and the newest */
  quarantine(): Promise<{ count: number; latest: QuarantineSummary[] }>;
  /** the newest `limit` quarantined episodes, whole, oldest first */
  quarantined(limit: number): Promise<QuarantineEntry[]>;
  /**
   * The next micro-batch of `rank`; `client` names the trainer process asking (its step plans are handed out to
   * one client at a time, in plan order: see `nextPlanned`).
   */
  next(rank: number, waitMs: number, client?: string): Promise<Handout | undefined>;
  /** acknowledges a micro-batch; acknowledging one again (a retry whose answer was lost) is answered, `repeated` */
  ack(id: string): Promise<Acked>;
  /**
   * The producers are done with the groups numbered so far (the end of a rollout): those may form steps smaller
   * than groupsPerStep; groups numbered later wait for full steps again. Resolves to that bound.
   */
  flush(): Promise<number>;
  /** whole finished groups for a consumer of records (slime), their episodes in group order */
  takeWhole<T>(max: number, read: (episodes: Episode[]) => T): Promise<T | undefined>;
  depth(): Promise<{ ready: number; leased: number }>;
  close(): Promise<void>;
}

/** The oldest policy that generated any of these calls (the trainer's version when none was recorded). */
export function oldestPolicy(episodes: Episode[], trainerVersion: number): number {
  let v = Infinity;
  for (const ep of episodes) for (const c of ep.calls) v = Math.min(v, c.policyVersion);
  return v === Infinity ? trainerVersion : v;
}

/** The manifest entry a trainer receives: the packer's fields, where the micro-batch comes from, its staleness. */
export function handoutEntry(
  packed: Record<string, unknown>,
  at: { id: string; step: number; rank: number; groups: string[]; policyVersion: number },
  trainerVersion: number,
  leaseMs: number,
  metrics: Metrics,
  reissued: boolean,
): Record<string, unknown> {
  metrics.microBatches.inc({ event: reissued ? 'reissued' : 'handed_out' });
  const staleness = trainerVersion - at.policyVersion;
  metrics.staleness.observe(staleness);
  return {
    ...packed,
    id: at.id,
    feed_step: at.step,
    rank: at.rank,
    groups: at.groups,
    policy_version: at.policyVersion,
    trainer_version: trainerVersion,
    staleness,
    lease_ms: leaseMs,
  };
}

/** Whether a step's micro-batches carry a step plan (packed with prefix reuse): they then go out as `nextPlanned` says. */
function planned(slots: MicroBatchSlot[]): boolean {
  return slots.some((s) => s.out.entry.prefix_tokens !== undefined);
}

/**
 * A rank's micro-batches of one planned step hang from prefixes that earlier ones of the rank pushed, so they go
 * out as a run: in plan order, all to the client that took the first. The run is the rank's unacknowledged
 * micro-batches of the step (U); its lease is that of U[0]. While it holds, only that client gets U's next one not
 * handed out in this run (a lease ending before U[0]'s is an earlier run's); another client gets nothing
 * of this step. Once it runs out, the run starts over from U[0], for whoever asks (`restart`): a trainer that died
 * part-way is replaced by one that starts the plan from its beginning, not from a micro-batch whose prefix only the
 * dead one held. undefined: nothing of this step for this client now.
 */
function nextPlanned(
  slots: MicroBatchSlot[],
  rank: number,
  client: string | undefined,
  now: number,
): MicroBatchSlot | 'restart' | undefined {
  const run = slots.filter((s) => s.rank === rank && !s.acked);
  if (run.length === 0) return undefined;
  const head = run[0];
  if (head.leasedUntil <= now) return 'restart';
  if (head.client !== client) return undefined;
  return run.find((s) => s.leasedUntil < head.leasedUntil);
}

export class Feed implements TrainerFeed {
  readonly collector: Collector;
  private readonly steps: Step[] = [];
  /** completed steps: the trainer's policy version */
  version = 0;
  /** steps whose records could not be packed, and why */
  readonly errors: string[] = [];
  private waiters: (() => void)[] = [];
  /** groups numbered below it may form smaller steps (a flush; logged, so a replay keeps it) */
  flushBelow = 0;
  /** steps before it are done */
  private firstOpen = 0;

  constructor(
    private readonly pool: Pool,
    private readonly opts: FeedOptions,
    private readonly pack: PackFn,
    private readonly append: (e: LogEvent) => Promise<void>,
    private readonly metrics: Metrics,
    private readonly dead: QuarantineFile,
    /** counts and logs entries newly quarantined */
    private readonly report: (entries: QuarantineEntry[]) => void,
  ) {
    this.collector = new Collector(opts.policy);
    pool.onGroupFinished = (seq) => {
      this.collector.complete(seq);
      this.wake();
    };
  }

  /**
   * Takes whole finished groups for a consumer of records (the slime rollout buffer) rather than micro-batches:
   * up to `max` as the policy allows, logged, then released from the pool once `read` has copied them out.
   */
  async takeWhole<T>(max: number, read: (episodes: Episode[]) => T): Promise<T | undefined> {
    const groups = this.collector.take(max);
    if (groups.length === 0) return undefined;
    const n = this.steps.length;
    const logged = this.append({ type: 'take', step: n, groups, whole: true });
    this.addStep(n, groups, logged);
    const out = read(this.episodesOf(groups));
    this.completeWhole(this.steps[n]);
    await logged;
    return out;
  }

  /** The finished episodes of these groups, in group order (abandoned ones are not trained). */
  private episodesOf(groups: number[]): Episode[] {
    return groups.flatMap((seq) => this.pool.bySeq[seq].episodes.map((id) => this.pool.episodes.get(id)!).filter((ep) => ep.finished));
  }

  private completeWhole(step: Step): void {
    step.done = true;
    step.slots = [];
    for (const g of step.groups) this.pool.release(g);
  }

  /** Replays the feed's own events (the pool replays the rest, before or between them, in log order). */
  apply(e: LogEvent): void {
    if (e.type === 'take') {
      this.collector.takeGroups(e.groups as number[]);
      this.addStep(e.step as number, e.groups as number[]);
      if (e.whole) this.completeWhole(this.steps[e.step as number]);
    }
    // Replayed in log order, the pool holds the groups it held when the flush was logged.
    else if (e.type === 'flush') this.flushBelow = Math.max(this.flushBelow, this.pool.bySeq.length);
    else if (e.type === 'snapshot') this.restore(e as unknown as SnapshotEvent);
    else if (e.type === 'handout') {
      const id = e.id as string;
      const step = this.steps[Number(id.split('.')[0])];
      if (!step) return;
      const client = e.client as string | undefined;
      step.leases.set(id, { until: e.until as number, ...(client !== undefined && { client }) });
      const slot = step.slots?.find((s) => s.id === id);
      if (slot) [slot.leasedUntil, slot.client] = [e.until as number, client];
    } else if (e.type === 'ack') {
      const id = e.id as string;
      const step = this.steps[Number(id.split('.')[0])];
      if (!step) return;
      this.markAcked(step, id);
      // A step acknowledged whole before the crash is done without packing it again.
      if (!step.slots && step.acked.size === e.of) {
        step.slots = [];
        this.finishStep(step);
      }
    }
  }

  /** A compacted log: consumed groups are taken, steps not replayed after the snapshot are done. */
  private restore(s: SnapshotEvent): void {
    this.flushBelow = snapshotFlushBelow(s);
    this.version = s.version;
    s.groups.forEach(([, , consumed], seq) => {
      if (consumed === 0) return;
      this.collector.complete(seq);
      this.collector.takeGroups([seq]);
    });
    for (let n = 0; n < s.steps; n++) {
      this.steps[n] = {
        n,
        groups: [],
        logged: Promise.resolve(),
        acked: new Set(),
        leases: new Map(),
        done: true,
        slots: [],
        compacted: true,
      };
    }
  }

  private addStep(n: number, groups: number[], logged = Promise.resolve()): void {
    this.steps[n] = { n, groups, logged, acked: new Set(), leases: new Map(), done: false };
  }

  private markAcked(step: Step, id: string): void {
    step.acked.add(id);
    const slot = step.slots?.find((s) => s.id === id);
    if (slot) slot.acked = true;
    this.maybeComplete(step);
  }

  private maybeComplete(step: Step): void {
    if (step.done || !step.slots || step.slots.some((s) => !s.acked)) return;
    this.finishStep(step);
  }

  private finishStep(step: Step): void {
    step.done = true;
    this.version++;
    for (const g of step.groups) this.pool.release(g);
    step.slots = step.slots!.map((s) => ({ ...s, out: { ...s.out, bytes: new Uint8Array(0) } }));
  }

  get head(): number {
    return this.collector.head;
  }

  async flush(): Promise<number> {
    // Durable before it takes effect: a step it lets form is handed out only after a replay would form it too.
    // The bound is the pool's groups as the event enters the log, which is what its replay sees.
    const below = this.pool.bySeq.length;
    if (below > this.flushBelow) await this.append({ type: 'flush' });
    this.flushBelow = Math.max(this.flushBelow, below);
    this.wake();
    return this.flushBelow;
  }

  async close(): Promise<void> {}

  async quarantine(): Promise<{ count: number; latest: QuarantineSummary[] }> {
    return { count: this.dead.count, latest: this.dead.summaries() };
  }

  async quarantined(limit: number): Promise<QuarantineEntry[]> {
    return this.dead.list(limit);
  }

  private wake(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }

  /** The next micro-batch for `rank`, waiting up to `waitMs` for one; undefined when none came. */
  async next(rank: number, waitMs: number, client?: string): Promise<Handout | undefined> {
    const deadline = Date.now() + waitMs;
    for (;;) {
      const h = await this.tryNext(rank, client);
      if (h) return h;
      const left = deadline - Date.now();
      if (left <= 0) return undefined;
      // Woken by a finished group; leases expire on their own clock, hence the bounded sleep.
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, Math.min(left, 200));
        this.waiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
  }

  private async tryNext(rank: number, client: string | undefined): Promise<Handout | undefined> {
    for (;;) {
      while (this.firstOpen < this.steps.length && this.steps[this.firstOpen].done) this.firstOpen++;
      const now = Date.now();
      // A client part-way through a step plan gets its next micro-batch before anything else: two plans never interleave.
      for (let k = this.firstOpen; k < this.steps.length; k++) {
        const slots = this.steps[k].slots;
        const run = slots && planned(slots) ? nextPlanned(slots, rank, client, now) : undefined;
        if (run && run !== 'restart') return await this.handOut(run, now, client);
      }
      for (let k = this.firstOpen; k < this.steps.length; k++) {
        const step = this.steps[k];
        if (step.done) continue;
        await this.packStep(step);
        const t = Date.now();
        if (planned(step.slots!)) {
          const run = nextPlanned(step.slots!, rank, client, t);
          if (run === 'restart')
            return await this.handOut(
              step.slots!.find((s) => s.rank === rank && !s.acked)!,
              t,
              client,
            );
          continue; // a run of this client's would have been continued above
        }
        const slot = step.slots!.find((s) => s.rank === rank && !s.acked && s.leasedUntil <= t);
        if (slot) return await this.handOut(slot, t, client);
      }
      if (!this.formStep()) return undefined;
    }
  }

  /** Leases the slot, durably: after a crash its acknowledgement is still accepted, and it is not handed out twice. */
  private async handOut(slot: MicroBatchSlot, now: number, client: string | undefined): Promise<Handout> {
    const reissued = slot.leasedUntil !== 0;
    slot.leasedUntil = now + this.opts.leaseMs; // taken now, so a concurrent pull skips it
    slot.client = client;
    await this.append({ type: 'handout', id: slot.id, until: slot.leasedUntil, ...(client !== undefined && { client }) });
    const groups = this.steps[slot.step].groups.map((g) => groupName(this.pool.bySeq[g].id));
    const where = { id: slot.id, step: slot.step, rank: slot.rank, groups, policyVersion: slot.minVersion };
    return {
      id: slot.id,
      bytes: slot.out.bytes,
      entry: handoutEntry(slot.out.entry, where, this.version, this.opts.leaseMs, this.metrics, reissued),
    };
  }

  /** Takes the next step's groups if the policy allows a full step now; true when a step was formed. */
  private formStep(): boolean {
    const groups = this.collector.ready(this.opts.groupsPerStep, this.pool.bySeq.length, this.flushBelow);
    if (groups.length === 0) return false;
    // Taken now, in memory, so no later completion can slip in front; handed out only once logged.
    this.collector.takeGroups(groups);
    const n = this.steps.length;
    this.addStep(n, groups, this.append({ type: 'take', step: n, groups }));
    return true;
  }

  private packStep(step: Step): Promise<void> {
    step.packing ??= (async () => {
      await step.logged;
      const episodes = this.episodesOf(step.groups);
      const minVersion = oldestPolicy(episodes, this.version);
      let packed: PackedOut[];
      let dead: Quarantined[] = [];
      try {
        ({ out: packed, quarantined: dead } = await this.pack(episodes));
      } catch (err) {
        if (err instanceof PackerUnavailable) {
          step.packing = undefined;
          throw err;
        }
        // The same records fail the same way after a replay: the step is dropped, with the reason kept.
        this.errors.push(
          `step ${step.n} (groups ${step.groups.map((g) => JSON.stringify(this.pool.bySeq[g].id)).join(', ')}): ${(err as Error).message}`,
        );
        this.metrics.rejected.inc({ reason: 'pack_error' });
        packed = [];
      }
      if (dead.length) {
        // Durable before any of the step goes out: a replay packs the step again, and adds none twice.
        const time = Date.now();
        try {
          this.report(await this.dead.add(dead.map((q) => ({ ...q, step: step.n, time }))));
        } catch (err) {
          step.packing = undefined;
          const why = `the quarantine file could not be written (${(err as Error).message})`;
          throw new PoolError(503, `${why}; the step is packed again at the next request`);
        }
      }
      step.slots = packed.map((out, i) => {
        const id = `${step.n}.${i}`;
        const lease = step.leases.get(id);
        return {
          id,
          step: step.n,
          rank: out.entry.rank ?? i % this.opts.dp,
          out,
          leasedUntil: lease?.until ?? 0,
          ...(lease?.client !== undefined && { client: lease.client }),
          acked: step.acked.has(id),
          minVersion,
        };
      });
      this.metrics.microBatches.inc({ event: 'packed' }, packed.length);
      this.maybeComplete(step);
    })();
    return step.packing;
  }

  async ack(id: string): Promise<Acked> {
    const m = /^(\d+)\.(\d+)$/.exec(id);
    const step = m ? this.steps[Number(m[1])] : undefined;
    // After a restart a step handed out before it is packed again at its first pull, or here, at its first ack.
    if (step && !step.done && !step.slots) await this.packStep(step);
    const slot = step?.slots?.find((s) => s.id === id);
    // Acknowledged before (a retry whose answer was lost): answered, as SQS answers a repeated delete. A step
    // restored from a compacted log is done with its micro-batches forgotten: any of its ids was acknowledged.
    if (step && (slot?.acked || step.acked.has(id) || (step.done && step.compacted))) {
      return { step: step.n, stepDone: step.done, trainerVersion: this.version, repeated: true };
    }
    if (!step || !slot) throw new PoolError(404, `unknown micro-batch id ${JSON.stringify(id)}`);
    if (slot.leasedUntil === 0) throw new PoolError(409, `micro-batch ${id} was not handed out`);
    await this.append({ type: 'ack', id, of: step.slots!.length });
    this.markAcked(step, id);
    this.metrics.microBatches.inc({ event: 'acked' });
    return { step: step.n, stepDone: step.done, trainerVersion: this.version, repeated: false };
  }

  async depth(): Promise<{ ready: number; leased: number }> {
    let ready = 0,
      leased = 0;
    const now = Date.now();
    for (let k = this.firstOpen; k < this.steps.length; k++) {
      const step = this.steps[k];
      if (!step.slots || step.done) continue;
      for (const s of step.slots) {
        if (s.acked) continue;
        if (s.leasedUntil > now) leased++;
        else ready++;
      }
    }
    return { ready, leased };
  }
}
