/**
 * Step plans with prefix reuse (docs/concepts/micro-batching.md, "Step plans"): a step's forest cut into micro-batches that may hang from a
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
import { lcpQuery } from './lcp.js';
import { piecesOn, sharedPieces, type Chain, type SharedPiece } from './share.js';

/**
 * The sorted sequences the prefix planner cuts, as budget.ts's `Runs` holds them: sort order, the common prefix
 * with the previous sequence, lengths, and the packed tokens and pairs of any contiguous run [i, j).
 */
export interface SortedRuns {
  readonly S: number;
  readonly order: Int32Array;
  readonly lcp: Int32Array;
  readonly seqLen: Int32Array;
  tokens(i: number, j: number): number;
  pairs(i: number, j: number): number;
}

/** What one micro-batch does with its rank's prefix stack (header `prefix_tokens`, `prefix_push`, `prefix_release`). */
export interface PrefixOp {
  /** nodes [0, tokens) are the cached chain: the stack's depth while the micro-batch runs */
  tokens: number;
  /** end depths of the segments pushed before it, ascending; the last is `tokens` */
  push: number[];
  /** segments popped (recomputed with grad and back-propagated) after it */
  release: number;
  /**
   * with shared prefixes (docs/design.md §11), one per `push` entry: the id of the shared piece that segment is (taken
   * from the piece's group, neither computed nor recomputed by this micro-batch's rank alone), or null
   */
  shared?: (number | null)[];
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
  /** with shared prefixes: tokens of the shared pieces (each counted once in computedTokens and pushedTokens) */
  sharedTokens?: number;
}

export interface PrefixOptions {
  /** most prefix tokens a rank may hold cached */
  cacheTokens: number;
  /** bytes one cached token costs (keys, values and their gradient buffers over all layers), for reports */
  bytesPerToken?: number;
  /** with K > 1: compute prefixes held by several ranks once, in shares (docs/design.md §11) */
  share?: boolean;
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
function cutTree(runs: SortedRuns, B: number): [number, number, number][] {
  const { S, lcp, seqLen } = runs;
  const out: [number, number, number][] = [];
  // A group made only of sequences that end on the cached chain computes nothing: it joins the next micro-batch.
  let carry = -1;
  const emit = (lo: number, hi: number, hang: number) => {
    out.push([carry >= 0 ? carry : lo, hi, hang]);
    carry = -1;
  };
  // The radix tree is walked with an explicit stack (agent chains nest one level per turn): a frame is a node at
  // depth d whose children [a, j) are still to be grouped, the open group starting at ga with `size` tokens below d.
  const frames: { j: number; d: number; a: number; ga: number; size: number }[] = [];
  const flush = (f: (typeof frames)[number], end: number) => {
    // A group of sequences ending at depth d (size 0) is carried into the next micro-batch, which lies below it;
    // an emit takes everything from the carry on, so groups carried meanwhile are taken too.
    if (end > f.ga && f.size > 0) emit(f.ga, end, f.d);
    else if (end > f.ga && carry < 0) carry = f.ga;
  };
  const enter = (i: number, j: number, d: number): void => {
    for (;;) {
      if (runs.tokens(i, j) - d <= B) return emit(i, j, d);
      if (j - i === 1) return emit(i, j, seqLen[i] - B); // one sequence longer than B below d: hang it deeper
      let c = Infinity;
      for (let k = i + 1; k < j; k++) c = Math.min(c, lcp[k]);
      if (c === d) return void frames.push({ j, d, a: i, ga: i, size: 0 });
      d = c; // the range shares a longer chain: its trunk is pushed
    }
  };
  if (S > 0) enter(0, S, 0);
  while (frames.length) {
    const f = frames[frames.length - 1];
    if (f.a >= f.j) {
      flush(f, f.j);
      frames.pop();
      continue;
    }
    const a = f.a;
    let b = a + 1;
    while (b < f.j && lcp[b] > f.d) b++;
    f.a = b;
    const child = runs.tokens(a, b) - f.d;
    if (child > B) {
      flush(f, a);
      [f.ga, f.size] = [b, 0];
      enter(a, b, f.d);
    } else if (f.size + child > B) {
      flush(f, a);
      [f.ga, f.size] = [a, child];
    } else f.size += child;
  }
  // Sequences equal to a chain sort before its extensions, so a carry is always taken by the next micro-batch.
  if (carry >= 0) throw new TreepackError('E_BACKEND', 'prefix plan: sequences ending on a cached chain were left without a micro-batch');
  return out;
}

/** Stack operations of one rank's micro-batches (DFS order), each given by its chain: [representative sorted position, depth]. */
function stackOps(
  chains: [number, number][],
  lcpOf: (a: number, b: number) => number,
  B: number,
  pieces: (m: number) => [number, number][] = () => [],
): { op: PrefixOp; from: number }[] {
  const n = chains.length;
  const common = (x: [number, number], y: [number, number]) => Math.min(x[1], y[1], lcpOf(x[0], y[0]));
  const down = Array.from({ length: n + 1 }, (_, m) => (m > 0 && m < n ? common(chains[m - 1], chains[m]) : 0));
  const ops: { op: PrefixOp; from: number }[] = [];
  let starts: number[] = [];
  for (let m = 0; m < n; m++) {
    const h = chains[m][1];
    const cuts = new Set<number>();
    // Until a later cut goes to down[m] or below (which releases all of them), a cut may fall inside these segments.
    for (let k = m + 1; k < n && down[k] > down[m]; k++) if (down[k] < h) cuts.add(down[k]);
    if (h > down[m]) cuts.add(h);
    // A shared piece on the chain is one segment: its ends are cuts, and nothing inside it is (a cut there comes from a
    // later chain on another branch: every chain that leaves this path inside a piece's depths split the piece there).
    const mine = pieces(m);
    for (const [a, b] of mine) for (const c of [a, b]) if (c > down[m] && c < h) cuts.add(c);
    for (const c of [...cuts]) if (mine.some(([a, b]) => a < c && c < b)) cuts.delete(c);
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

/**
 * Contiguous spans of the micro-batches (DFS order) over at most K ranks minimising the slowest rank's load, where a
 * micro-batch costs its own work plus pushing the part of its chain the previous one on its rank did not hold (its
 * whole chain when it starts a rank): a binary search on the load limit, each limit checked greedily. Returns each
 * micro-batch's rank.
 */
function spans(own: number[], push: (m: number, from: number) => number, down: number[], K: number): number[] {
  const n = own.length;
  const fill = (limit: number): number[] | null => {
    const rank = new Array<number>(n);
    let r = 0,
      load = 0;
    for (let m = 0; m < n; m++) {
      let inc = own[m] + push(m, m > 0 ? down[m] : 0);
      if (m > 0 && load + inc > limit) {
        r++;
        load = 0;
        inc = own[m] + push(m, 0);
      }
      if (inc > limit || r >= K) return null;
      rank[m] = r;
      load += inc;
    }
    return rank;
  };
  let lo = 0,
    hi = 0;
  for (let m = 0; m < n; m++) {
    lo = Math.max(lo, own[m] + push(m, 0));
    hi += own[m] + push(m, 0);
  }
  let best = fill(hi)!;
  if (!fill(lo)) {
    for (let it = 0; it < 50 && hi - lo > 1e-9 * hi; it++) {
      const mid = (lo + hi) / 2;
      const got = fill(mid);
      if (got) [hi, best] = [mid, got];
      else lo = mid;
    }
  } else best = fill(lo)!;
  return best;
}

/**
 * The prefix-reuse plan of sorted runs under B computed tokens per micro-batch, over K ranks; throws when a rank
 * would need more cached tokens than `prefix.cacheTokens`.
 */
export function planPrefixRuns(
  runs: SortedRuns,
  B: number,
  K: number,
  cost: CostModel,
  prefix: PrefixOptions,
  ids?: readonly string[],
): { runs: PlannedRun[]; stats: PrefixPlanStats; shared: SharedPiece[]; shareLoad: Float64Array } {
  const C = prefix.cacheTokens;
  if (!Number.isSafeInteger(C) || C < 0) throw argError('prefixCacheTokens', 'an integer >= 0', C);
  const bpt = prefix.bytesPerToken;
  if (bpt !== undefined && !(Number.isFinite(bpt) && bpt >= 0)) throw argError('prefixBytesPerToken', 'a finite number >= 0', bpt);
  const lcpOf = lcpQuery(runs.lcp);
  const lcpAt = (a: number, b: number) => (a === b ? runs.seqLen[a] : lcpOf(Math.min(a, b), Math.max(a, b)));
  // The chain of [lo, hi) hanging at h is the root path of its first sequence long enough to hold it.
  const chainOf = ([lo, hi, h]: [number, number, number]): [number, number] => {
    let rep = lo;
    while (rep + 1 < hi && runs.seqLen[rep] < h) rep++;
    return [rep, h];
  };
  const plannedOn = (items: [number, number, number][], rank: number, pieces: readonly SharedPiece[] = []): PlannedRun[] => {
    const chains = items.map(chainOf);
    const on = chains.map(([rep, h]) => piecesOn(pieces, rep, h, lcpAt));
    const ops = stackOps(chains, lcpAt, B, (m) => on[m].map((id): [number, number] => [pieces[id].start, pieces[id].end]));
    return items.map(([lo, hi, h], step) => {
      const { op, from } = ops[step];
      const computed = runs.tokens(lo, hi) - h,
        pairs = runs.pairs(lo, hi) - pathPairs(h);
      let pushedTokens = h - from,
        pushedPairs = pathPairs(h) - pathPairs(from);
      if (pieces.length > 0) {
        // A pushed segment that is a shared piece comes from the piece's group: it is not this rank's own push.
        op.shared = op.push.map((e, k) => {
          const s = k > 0 ? op.push[k - 1] : from;
          const id = on[step].find((i) => pieces[i].start === s && pieces[i].end === e);
          if (id !== undefined) {
            if (!pieces[id].ranks.includes(rank))
              throw new TreepackError('E_BACKEND', `shared prefix: rank ${rank} holds a piece outside its group`);
            pushedTokens -= e - s;
            pushedPairs -= pathPairs(e) - pathPairs(s);
            return id;
          }
          if (on[step].some((i) => pieces[i].start < e && pieces[i].end > s))
            throw new TreepackError('E_BACKEND', `shared prefix: rank ${rank} pushes [${s}, ${e}), which straddles a shared piece`);
          return null;
        });
      }
      const c = microBatchCost(computed, pairs, cost) + PUSH_COST * microBatchCost(pushedTokens, pushedPairs, cost);
      return { lo, hi, rank, step, op, computed, pairs, pushedTokens, pushedPairs, cost: c };
    });
  };
  // With K > 1 the cut is also tried finer (budgets B/2, B/4, … down to an eighth of a rank's share): more, smaller
  // micro-batches balance the ranks better, at the price of pushing more chains. The plan whose slowest rank is
  // fastest wins; ties go to fewer computed tokens, then the larger budget.
  const total = runs.S > 0 ? runs.tokens(0, runs.S) : 0;
  const budgets = [B];
  if (K > 1) for (let b = Math.floor(B / 2); b >= Math.max(1, Math.ceil(total / (8 * K))); b = Math.floor(b / 2)) budgets.push(b);
  let out: PlannedRun[] | null = null,
    bestLoad = Infinity,
    bestComputed = Infinity;
  let bestB = B;
  let need: PlannedRun | null = null; // the deepest chain of the plan that needs the least cache, for the refusal
  for (const b of budgets) {
    const cut = cutTree(runs, b);
    const chains = cut.map(chainOf);
    const own = cut.map(([lo, hi, h]) => microBatchCost(runs.tokens(lo, hi) - h, runs.pairs(lo, hi) - pathPairs(h), cost));
    const down = chains.map((c, m) => (m > 0 ? Math.min(c[1], chains[m - 1][1], lcpAt(chains[m - 1][0], c[0])) : 0));
    const push = (m: number, from: number) =>
      PUSH_COST * microBatchCost(chains[m][1] - from, pathPairs(chains[m][1]) - pathPairs(from), cost);
    const rank = K > 1 ? spans(own, push, down, K) : cut.map(() => 0);
    const planned: PlannedRun[] = [];
    for (let r = 0; r < K; r++)
      planned.push(
        ...plannedOn(
          cut.filter((_, m) => rank[m] === r),
          r,
        ),
      );
    const loads = new Float64Array(K);
    let computed = 0;
    for (const p of planned) {
      loads[p.rank] += p.cost;
      computed += p.computed + p.pushedTokens;
    }
    const load = Math.max(...loads);
    const deepest = planned.reduce<PlannedRun | null>((a, p) => (a === null || p.op.tokens > a.op.tokens ? p : a), null);
    if (deepest && deepest.op.tokens > C) {
      if (need === null || deepest.op.tokens < need.op.tokens) need = deepest;
      continue;
    }
    if (load < bestLoad * (1 - 1e-9) || (load <= bestLoad * (1 + 1e-9) && computed < bestComputed))
      [out, bestLoad, bestComputed, bestB] = [planned, load, computed, b];
  }
  if (out === null) {
    const rep = chainOf([need!.lo, need!.hi, need!.op.tokens])[0];
    throw new TreepackError(
      'E_ARG',
      `the step plan needs ${need!.op.tokens} cached prefix tokens on rank ${need!.rank} (a prefix shared by the micro-batches under it; the sequence has ${runs.seqLen[rep]} tokens), but the prefix cache allows ${C}; raise --prefix-reuse or plan without prefix reuse`,
      ids ? { record: ids[runs.order[rep]] } : {},
    );
  }
  let shared: SharedPiece[] = [];
  if (prefix.share && K > 1) {
    // Out lists ranks in order, each in DFS order: together the DFS order of the chains.
    const chains: Chain[] = out.map((p) => ({ rep: chainOf([p.lo, p.hi, p.op.tokens])[0], h: p.op.tokens, rank: p.rank }));
    shared = sharedPieces(chains, lcpAt, bestB);
    if (shared.length > 0) {
      const byRank: [number, number, number][][] = Array.from({ length: K }, () => []);
      for (const p of out) byRank[p.rank].push([p.lo, p.hi, p.op.tokens]);
      out = byRank.flatMap((items, r) => plannedOn(items, r, shared));
    }
  }
  // A rank holds its pieces from the start of the step to its end, beside its own stack.
  const pinned = new Float64Array(K);
  const shareLoad = new Float64Array(K);
  let sharedTokens = 0;
  for (const p of shared) {
    sharedTokens += p.end - p.start;
    p.ranks.forEach((r, i) => {
      const [a, b] = p.ranges[i];
      pinned[r] += p.end - p.start;
      shareLoad[r] += PUSH_COST * microBatchCost(b - a, pathPairs(b) - pathPairs(a), cost);
    });
  }
  let computedTokens = sharedTokens,
    pushedTokens = sharedTokens,
    peak = 0;
  for (const p of out) {
    computedTokens += p.computed + p.pushedTokens;
    pushedTokens += p.pushedTokens;
    // Pieces pushed before it on its stack are counted in its chain; the others a rank holds are counted apart.
    const below = sharedBelow(p, shared, lcpAt, chainOf);
    peak = Math.max(peak, p.op.tokens - below + pinned[p.rank]);
  }
  if (peak > C) {
    const worst = out.find((p) => p.op.tokens - sharedBelow(p, shared, lcpAt, chainOf) + pinned[p.rank] === peak)!;
    throw new TreepackError(
      'E_ARG',
      `the step plan with shared prefixes needs ${peak} cached prefix tokens on rank ${worst.rank}, but the prefix cache allows ${C}; raise --prefix-reuse or pack with --no-shared-prefix`,
      ids ? { record: ids[runs.order[worst.lo]] } : {},
    );
  }
  const stats: PrefixPlanStats = {
    computedTokens,
    pushedTokens,
    peakCachedTokens: peak,
    ...(bpt !== undefined && { peakCachedBytes: peak * bpt }),
    ...(prefix.share && K > 1 && { sharedTokens }),
  };
  return { runs: out, stats, shared, shareLoad };
}

/** Tokens of the shared pieces on the chain run `p` hangs from (all of them held by its rank). */
function sharedBelow(
  p: PlannedRun,
  shared: readonly SharedPiece[],
  lcpAt: (a: number, b: number) => number,
  chainOf: (x: [number, number, number]) => [number, number],
): number {
  if (shared.length === 0) return 0;
  const [rep, h] = chainOf([p.lo, p.hi, p.op.tokens]);
  return piecesOn(shared, rep, h, lcpAt).reduce((a, id) => a + shared[id].end - shared[id].start, 0);
}
