/**
 * Scheduling policies for streaming rollouts: which finished groups the trainer takes next.
 *
 * Groups are numbered 0, 1, … in submission order and finish in any order.
 * - windowed FIFO: only finished groups inside the window [head, head+W) are taken, in submission order; head
 *   is the oldest group not taken yet, so it advances as the front is consumed. Staleness is bounded (a group
 *   can only be overtaken by the W-1 groups after it) at the price of waiting for slow groups at the front.
 * - fully asynchronous: finished groups in completion order; no waiting, unbounded staleness.
 */
import { argError } from '../errors.js';

/** Which finished groups the trainer may take: in submission order within a window of `window` groups, or as they finish (`async`). */
export type CollectorPolicy = { kind: 'windowed-fifo'; window: number } | { kind: 'async' };

/** Takes finished groups for training in the order its policy allows. */
export class Collector {
  private readonly finished: number[] = []; // completion order
  private readonly done = new Set<number>();
  private readonly taken = new Set<number>();
  private front = 0;
  private firstUntaken = 0; // into `finished`: everything before it is taken
  constructor(readonly policy: CollectorPolicy) {
    if (policy?.kind === 'windowed-fifo') {
      if (!Number.isSafeInteger(policy.window) || policy.window < 1) throw argError('policy.window', 'an integer >= 1', policy.window);
    } else if (policy?.kind !== 'async')
      throw argError('policy.kind', "'windowed-fifo' or 'async'", (policy as { kind?: unknown } | undefined)?.kind);
  }

  /**
   * A collector whose groups below `front` are all taken: a long run's state without its history (a mirror of
   * the policy rebuilt from a trimmed log).
   */
  static startingAt(policy: CollectorPolicy, front: number): Collector {
    if (!Number.isSafeInteger(front) || front < 0) throw argError('front', 'an integer >= 0', front);
    const c = new Collector(policy);
    c.front = front;
    return c;
  }

  /** The oldest group not taken yet. */
  get head(): number {
    return this.front;
  }

  complete(group: number): void {
    if (!Number.isSafeInteger(group) || group < 0) throw argError('group', 'an integer >= 0', group);
    if (this.done.has(group)) throw argError('group', 'a group not completed before', group);
    this.done.add(group);
    this.finished.push(group);
  }

  /** Up to `max` groups the policy allows now, marked taken. */
  take(max: number): number[] {
    const out = this.peek(max);
    this.takeGroups(out);
    return out;
  }

  /** Marks these finished groups taken: a decision made earlier (by take), replayed from a log. */
  takeGroups(groups: readonly number[]): void {
    for (const g of groups) {
      if (!this.done.has(g) || this.taken.has(g)) throw argError('group', 'a completed group not taken before', g);
      this.taken.add(g);
    }
    while (this.taken.has(this.front)) this.front++;
    while (this.firstUntaken < this.finished.length && this.taken.has(this.finished[this.firstUntaken])) this.firstUntaken++;
  }

  /**
   * The groups of the next step of `size`, or none to wait: a full step when the policy allows one; with a
   * windowed FIFO also a smaller one when the window is stuck (it lies within the `submitted` groups and each of
   * them is finished or taken, so no completion can add to it and waiting would never end). `flushBelow` (the
   * input has ended for the groups numbered below it) takes whatever the policy allows of those groups.
   */
  ready(size: number, submitted: number, flushBelow = 0): number[] {
    const out = this.peek(size);
    if (out.length === size || out.length === 0) return out;
    if (this.front < flushBelow) {
      const flushed = out.filter((g) => g < flushBelow);
      if (flushed.length > 0) return flushed;
    }
    if (this.policy.kind === 'async') return [];
    const end = this.front + this.policy.window;
    if (end > submitted) return [];
    for (let g = this.front; g < end; g++) if (!this.done.has(g) && !this.taken.has(g)) return [];
    return out;
  }

  /** Up to `max` groups the policy allows now, left in place. */
  peek(max: number): number[] {
    const out: number[] = [];
    if (this.policy.kind === 'async') {
      for (let k = this.firstUntaken; k < this.finished.length && out.length < max; k++) {
        if (!this.taken.has(this.finished[k])) out.push(this.finished[k]);
      }
    } else {
      const end = this.front + this.policy.window;
      for (let g = this.front; g < end && out.length < max; g++) if (this.done.has(g) && !this.taken.has(g)) out.push(g);
    }
    return out;
  }
}

/** A group in a schedule simulation: when it was submitted and when it completed. */
export interface SimulatedGroup {
  submitted: number;
  completed: number;
}

/** What a simulated schedule did: the batches it formed and how long groups waited. */
export interface ScheduleReport {
  /** groups of each training batch, in the order taken, and the time the batch was formed */
  batches: { groups: number[]; time: number }[];
  /** per group: policy versions (batches formed) between its submission and the batch that took it */
  staleness: Int32Array;
  meanStaleness: number;
  maxStaleness: number;
  /** mean time a finished group waited to be taken */
  meanWait: number;
}

/**
 * Replays completions in time order (ties by group number) and forms a batch whenever `batchGroups` groups
 * are takeable; at the end, what is left is taken in smaller batches.
 */
export function simulateCollector(policy: CollectorPolicy, groups: readonly SimulatedGroup[], batchGroups: number): ScheduleReport {
  if (!Number.isSafeInteger(batchGroups) || batchGroups < 1) throw argError('batchGroups', 'an integer >= 1', batchGroups);
  const c = new Collector(policy);
  const order = groups.map((_, i) => i).sort((x, y) => groups[x].completed - groups[y].completed || x - y);
  const batches: ScheduleReport['batches'] = [];
  const takenAt = new Int32Array(groups.length);
  const form = (time: number, max: number): boolean => {
    const g = c.take(max);
    if (g.length === 0) return false;
    for (const x of g) takenAt[x] = batches.length;
    batches.push({ groups: g, time });
    return true;
  };
  const submissions = groups.map((x) => x.submitted).sort((a, b) => a - b);
  let submitted = 0;
  for (const g of order) {
    c.complete(g);
    const t = groups[g].completed;
    while (submitted < submissions.length && submissions[submitted] <= t) submitted++;
    // A batch is formed when a full one is takeable (the window may hold finished groups back), or a smaller one
    // when the window is stuck.
    while (c.ready(batchGroups, submitted).length > 0) form(t, c.ready(batchGroups, submitted).length);
  }
  const end = groups.reduce((t, x) => Math.max(t, x.completed), 0);
  while (form(end, batchGroups));
  const times = batches.map((b) => b.time);
  const staleness = new Int32Array(groups.length);
  let sum = 0,
    max = 0,
    wait = 0;
  for (let g = 0; g < groups.length; g++) {
    // Versions published by the time of submission: batches formed at or before it.
    let v = 0;
    while (v < times.length && times[v] <= groups[g].submitted) v++;
    staleness[g] = takenAt[g] - v;
    sum += staleness[g];
    max = Math.max(max, staleness[g]);
    wait += times[takenAt[g]] - groups[g].completed;
  }
  const n = Math.max(1, groups.length);
  return { batches, staleness, meanStaleness: sum / n, maxStaleness: max, meanWait: wait / n };
}
