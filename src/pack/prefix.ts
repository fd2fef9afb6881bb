/**
 * Step plans with prefix reuse (README "Step plans"): a step's forest cut into micro-batches that may hang from a
 * prefix an earlier micro-batch of the same rank computed, so a long shared trunk is computed once per rank, not
 * once per micro-batch.
 *
 * The cut follows the forest's radix tree (sorted sequences and their adjacent LCPs). A subtree below the cached
 * chain of depth d that fits the budget is one micro-batch; consecutive small sibling subtrees share one; a subtree
 * too big pushes its trunk (down to its own branch point) and recurses. So every node is computed with grad once
 * on a rank, in a micro-batch or as a popped prefix segment, and the only repeat is a prefix whose branches span
 * two ranks. Micro-batches run in DFS order, cut into contiguous per-rank spans balanced by cost, so a prefix's
 * branches stay on one rank before it is repeated on another.
 *
 * Each micro-batch's forest is its sequences' whole forest; its first `tokens` nodes (the first sorted sequence's
 * root path, a chain) are the cached prefix. Its stack operations: `push` (the end depths of the segments run
 * without grad before it, from the stack's depth), `release` (segments popped after it, top first, each recomputed
 * with grad). Segments are split where a later cut falls and every `B` tokens (a pop computes one segment with
 * grad, so it fits the budget too).
 */
import { TreepackError, argError } from '../errors.js';
import { microBatchCost, pathPairs, type CostModel } from './balance.js';
import type { Runs } from './budget.js';
import { lcpQuery } from './lcp.js';

/** What one micro-batch does with its rank's prefix stack (header `prefix_tokens`, `prefix_push`, `prefix_release`). */
export interface PrefixOp {
  /** nodes [0, tokens) are the cached chain: the stack's depth while the micro-batch runs */
  tokens: number;
  /** end depths of the segments pushed before it, ascending; the last is `tokens` */
  push: number[];
  /** segments popped (recomputed with grad and back-propagated) after it */
  release: number;
}

export interface PrefixPlanStats {
  /** tokens run with grad on all ranks: micro-batches' own nodes plus every popped segment */
  computedTokens: number;
  /** tokens run without grad to fill the caches (each popped segment once) */
  pushedTokens: number;
  /** most cached prefix tokens a rank holds at once */
  peakCachedTokens: number;
  /** peakCachedTokens × bytesPerToken, when that is given */
  peakCachedBytes?: number;
}

export interface PrefixOptions {
  /** most prefix tokens a rank may hold cached */
  cacheTokens: number;
  /** bytes one cached token costs (keys, values and their gradient buffers over all layers), for reports */
  bytesPerToken?: number;
}

export interface PlannedRun {
  /** sorted positions [lo, hi) */
  lo: number;
  hi: number;
  rank: number;
  step: number;
  op: PrefixOp;
  /** nodes computed with grad by the micro-batch itself (its forest less the cached chain) */
  computed: number;
  pairs: number;
  /** pushed before it: tokens and attention pairs */
  pushedTokens: number;
  pushedPairs: number;
  cost: number;
}

/** A no-grad forward is about a third of a forward and backward; a pushed segment is also popped (one of each). */
const PUSH_COST = 1 / 3 + 1;

/**
 * Cuts the sorted sequences of `runs` into micro-batches of at most B computed tokens each hanging from a cached
 * chain, in DFS order: [lo, hi, hang].
 */
function cutTree(runs: Runs, B: number): [number, number, number][] {
  const { S, lcp, seqLen } = runs;
  const out: [number, number, number][] = [];
  // A group made only of sequences that end on the cached chain computes nothing: it joins the next micro-batch.
  let carry = -1;
  const emit = (lo: number, hi: number, hang: number) => {
    out.push([carry >= 0 ? carry : lo, hi, hang]);
    carry = -1;
  };
  const plan = (i: number, j: number, d: number): void => {
    if (runs.tokens(i, j) - d <= B) return emit(i, j, d);
    if (j - i === 1) return emit(i, j, seqLen[i] - B); // one sequence longer than B below d: hang it deeper
    let c = Infinity;
    for (let k = i + 1; k < j; k++) c = Math.min(c, lcp[k]);
    if (c > d) return plan(i, j, c);
    let ga = i, size = 0;
    const flush = (end: number) => {
      if (end > ga) {
        if (size === 0 && carry < 0) carry = ga;
        else if (size > 0) emit(ga, end, d);
      }
    };
    for (let a = i; a < j; ) {
      let b = a + 1;
      while (b < j && lcp[b] > d) b++;
      const child = runs.tokens(a, b) - d;
      if (child > B) {
        flush(a); // a leading group of sequences ending at depth d is carried into the child's first micro-batch
        plan(a, b, d);
        ga = b;
        size = 0;
      } else if (size + child > B) {
        flush(a);
        [ga, size] = [a, child];
      } else size += child;
      a = b;
    }
    flush(j);
  };
  if (S > 0) plan(0, S, 0);
  // Sequences equal to a chain sort before its extensions, so a carry is always taken by the next micro-batch.
  if (carry >= 0) throw new TreepackError('E_BACKEND', 'prefix plan: sequences ending on a cached chain were left without a micro-batch');
  return out;
}

/** Stack operations of one rank's micro-batches (DFS order), each given by its chain: [representative sorted position, depth]. */
function stackOps(chains: [number, number][], lcpOf: (a: number, b: number) => number, B: number): { op: PrefixOp; from: number }[] {
  const n = chains.length;
  const common = (x: [number, number], y: [number, number]) => Math.min(x[1], y[1], lcpOf(x[0], y[0]));
  const down = Array.from({ length: n + 1 }, (_, m) => (m > 0 && m < n ? common(chains[m - 1], chains[m]) : 0));
  const ops: { op: PrefixOp; from: number }[] = [];
  let starts: number[] = [];
  for (let m = 0; m < n; m++) {
    const h = chains[m][1];
    const cuts = new Set<number>();
    for (let k = m + 1; k < n && down[m] < h; k++) if (down[k] > down[m] && down[k] < h) cuts.add(down[k]);
    if (h > down[m]) cuts.add(h);
    const ends: number[] = [];
    let at = down[m];
    for (const e of [...cuts].sort((x, y) => x - y)) {
      for (; e - at > B; at += B) ends.push(at + B);
      ends.push(e);
      at = e;
    }
    starts.push(...[down[m], ...ends.slice(0, -1)].slice(0, ends.length));
    const keep = starts.filter((s) => s < down[m + 1]);
    ops.push({ op: { tokens: h, push: ends, release: starts.length - keep.length }, from: Math.min(h, down[m]) });
    starts = keep;
  }
  return ops;
}

/** Contiguous spans of the costs over K ranks: span r ends where the running sum is nearest to (r+1)/K of the total. */
function spans(costs: number[], K: number): number[] {
  const total = costs.reduce((a, c) => a + c, 0);
  const rank = new Array<number>(costs.length);
  let r = 0, sum = 0;
  for (let m = 0; m < costs.length; m++) {
    const target = ((r + 1) * total) / K;
    // Move on when this micro-batch lands further past the target than the span stops short of it.
    if (r < K - 1 && m > 0 && sum + costs[m] - target > target - sum && sum > 0) r++;
    rank[m] = r;
    sum += costs[m];
  }
  return rank;
}

/**
 * The prefix-reuse plan of sorted runs under B computed tokens per micro-batch, over K ranks; throws when a rank
 * would need more cached tokens than `prefix.cacheTokens`.
 */
export function planPrefixRuns(runs: Runs, B: number, K: number, cost: CostModel, prefix: PrefixOptions, ids?: readonly string[]): { runs: PlannedRun[]; stats: PrefixPlanStats } {
  const C = prefix.cacheTokens;
  if (!Number.isSafeInteger(C) || C < 0) throw argError('prefixCacheTokens', 'an integer >= 0', C);
  const bpt = prefix.bytesPerToken;
  if (bpt !== undefined && !(Number.isFinite(bpt) && bpt >= 0)) throw argError('prefixBytesPerToken', 'a finite number >= 0', bpt);
  const lcpOf = lcpQuery(runs.lcp);
  const lcpAt = (a: number, b: number) => (a === b ? runs.seqLen[a] : lcpOf(Math.min(a, b), Math.max(a, b)));
  const cut = cutTree(runs, B);
  // The chain of [lo, hi) hanging at h is the root path of its first sequence long enough to hold it.
  const chainOf = ([lo, hi, h]: [number, number, number]): [number, number] => {
    let rep = lo;
    while (rep + 1 < hi && runs.seqLen[rep] < h) rep++;
    return [rep, h];
  };
  const plannedOn = (items: [number, number, number][], rank: number): PlannedRun[] => {
    const ops = stackOps(items.map(chainOf), lcpAt, B);
    return items.map(([lo, hi, h], step) => {
      const { op, from } = ops[step];
      const computed = runs.tokens(lo, hi) - h, pairs = runs.pairs(lo, hi) - pathPairs(h);
      const pushedTokens = h - from, pushedPairs = pathPairs(h) - pathPairs(from);
      const c = microBatchCost(computed, pairs, cost) + PUSH_COST * microBatchCost(pushedTokens, pushedPairs, cost);
      return { lo, hi, rank, step, op, computed, pairs, pushedTokens, pushedPairs, cost: c };
    });
  };
  const single = plannedOn(cut, 0);
  const rankOf = K > 1 ? spans(single.map((p) => p.cost), K) : single.map(() => 0);
  const out: PlannedRun[] = [];
  for (let r = 0; r < K; r++) out.push(...(K > 1 ? plannedOn(cut.filter((_, m) => rankOf[m] === r), r) : single));
  let computedTokens = 0, pushedTokens = 0, peak = 0;
  for (const p of out) {
    computedTokens += p.computed + p.pushedTokens;
    pushedTokens += p.pushedTokens;
    if (p.op.tokens > peak) peak = p.op.tokens;
    if (p.op.tokens > C) {
      throw new TreepackError(
        'E_ARG',
        `the step plan needs ${p.op.tokens} cached prefix tokens on rank ${p.rank} (a prefix shared by the micro-batches under it), but the prefix cache allows ${C}; raise --prefix-reuse or plan without prefix reuse`,
        ids ? { record: ids[runs.order[p.lo]] } : {},
      );
    }
  }
  const stats: PrefixPlanStats = { computedTokens, pushedTokens, peakCachedTokens: peak, ...(bpt !== undefined && { peakCachedBytes: peak * bpt }) };
  return { runs: out, stats };
}
