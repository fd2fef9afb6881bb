/**
 * Balancing refinement of a contiguous plan (budget.ts): contiguous runs of sorted sequences keep the most
 * sharing, but their sizes are fixed by where the cuts can fall, so a few large episodes can leave one rank well
 * above the mean. This pass moves whole units (a subtree of a micro-batch: one sequence, or a run of sorted
 * members that share a longer prefix with each other than with their neighbours, such as an episode) from a
 * micro-batch on the slowest rank to a micro-batch on another rank, or swaps two units, whenever that lowers the
 * slowest rank's cost.
 *
 * Packed size of a set of sequences = Σ len − Σ lcp(adjacent members in sorted order), so removing a unit or
 * inserting one changes only the adjacent pairs around it: each candidate is priced exactly, in O(units' size ·
 * log), from the sorted positions and an LCP range-minimum table. A move is taken only if
 *   - both micro-batches stay within the token budget (padding included),
 *   - the window's packed tokens stay within `maxTotal` (the caller's trade-off: tokens for balance),
 *   - the larger of the two ranks' new loads is below the slowest rank's old load, and the imbalance
 *     (max ÷ mean) does not rise.
 * Each accepted move replaces the largest load by two smaller ones, so the sorted load vector falls
 * lexicographically and the search ends; a work cap bounds it on large windows. Candidates are scanned in a fixed
 * order of sorted positions and the best is taken with ties to the first, so the result depends only on the
 * multiset of sequences.
 */
import { TreepackError } from '../errors.js';
import { pathPairs } from './balance.js';
import type { LcpQuery } from './lcp.js';

export interface RefineInput {
  /** sequence length by sorted position */
  len: Int32Array;
  lcpOf: LcpQuery;
  /** per micro-batch, its members as sorted positions, ascending */
  members: Int32Array[];
  /** rank of each micro-batch; unchanged by the refinement, so every rank keeps its number of steps */
  rank: Int32Array;
  K: number;
  /** most unpadded packed tokens per micro-batch */
  budget: number;
  /** cost of a micro-batch from its unpadded packed tokens and attention pairs (padding added by the caller's rule) */
  costOf: (tokens: number, pairs: number) => number;
  /** most unpadded packed tokens over all micro-batches */
  maxTotal: number;
}

export interface Refined {
  members: Int32Array[];
  /** unpadded packed tokens and attention pairs per micro-batch */
  tokens: Float64Array;
  pairs: Float64Array;
  /** accepted moves and swaps */
  moves: number;
}

/** Candidate evaluations are capped at about this many sorted positions touched; beyond it the plan is kept as is. */
const MAX_WORK = 1 << 22;
/**
 * Swaps are tried between two micro-batches only while their unit counts multiply to at most this: swaps matter
 * where units are coarse (a few episodes per micro-batch); in large micro-batches single moves already come in
 * fine steps, and all pairs of units would be quadratic.
 */
const MAX_SWAP_PAIRS = 1 << 12;
/** Ranks within 0.1% of the mean are balanced: finer gains are below the cost model's accuracy. */
const TOLERANCE = 1e-3;

/** A unit: members [i, j) of a micro-batch (indices into its sorted member list). */
interface Unit {
  i: number;
  j: number;
}

/** Unit u of micro-batch a goes to micro-batch c, in exchange for c's unit v (none: a move); the new sizes. */
interface Candidate {
  a: number;
  u: Unit;
  c: number;
  v: Unit | null;
  ta: number;
  pa: number;
  tc: number;
  pc: number;
}

/** One micro-batch: sorted members with prefix sums, so removing any run of members is priced in O(1). */
class Bin {
  readonly m: Int32Array;
  readonly tokens: number;
  readonly pairs: number;
  private readonly L: Float64Array; // Σ len over members [0, t)
  private readonly LP: Float64Array; // Σ pathPairs(len)
  private readonly H: Float64Array; // Σ lcp(m[u-1], m[u]) for u in 1..t
  private readonly HP: Float64Array; // Σ pathPairs(lcp)
  private unitList?: Unit[];
  constructor(
    m: Int32Array,
    private readonly ctx: RefineInput,
  ) {
    const k = m.length;
    this.m = m;
    this.L = new Float64Array(k + 1);
    this.LP = new Float64Array(k + 1);
    this.H = new Float64Array(Math.max(1, k));
    this.HP = new Float64Array(Math.max(1, k));
    for (let t = 0; t < k; t++) {
      const l = ctx.len[m[t]];
      this.L[t + 1] = this.L[t] + l;
      this.LP[t + 1] = this.LP[t] + pathPairs(l);
      if (t > 0) {
        const h = ctx.lcpOf(m[t - 1], m[t]);
        this.H[t] = this.H[t - 1] + h;
        this.HP[t] = this.HP[t - 1] + pathPairs(h);
      }
    }
    this.tokens = k > 0 ? this.L[k] - this.H[k - 1] : 0;
    this.pairs = k > 0 ? this.LP[k] - this.HP[k - 1] : 0;
  }

  /**
   * Singletons and the subtrees of this micro-batch's own forest (LCP intervals of its adjacent-LCP array, by the
   * usual stack walk), ordered by first member then size.
   */
  units(): Unit[] {
    if (this.unitList) return this.unitList;
    const k = this.m.length,
      out: Unit[] = [];
    const stackL: number[] = [],
      stackB: number[] = [];
    for (let t = 1; t <= k; t++) {
      const cur = t < k ? this.H[t] - this.H[t - 1] : -1;
      let lb = t - 1;
      while (stackL.length && stackL[stackL.length - 1] > cur) {
        stackL.pop();
        lb = stackB.pop()!;
        out.push({ i: lb, j: t });
      }
      if (cur >= 0 && (!stackL.length || stackL[stackL.length - 1] < cur)) {
        stackL.push(cur);
        stackB.push(lb);
      }
    }
    for (let t = 0; t < k; t++) out.push({ i: t, j: t + 1 });
    out.sort((x, y) => x.i - y.i || x.j - y.j);
    return (this.unitList = out);
  }

  /** Change in (tokens, pairs) when members [i, j) leave. */
  removal(i: number, j: number, d: Float64Array): void {
    const { m, L, LP, H, HP } = this,
      k = m.length;
    let dt = -(L[j] - L[i]) + (H[j - 1] - H[i]);
    let dp = -(LP[j] - LP[i]) + (HP[j - 1] - HP[i]);
    if (i > 0) {
      dt += H[i] - H[i - 1];
      dp += HP[i] - HP[i - 1];
    }
    if (j < k) {
      dt += H[j] - H[j - 1];
      dp += HP[j] - HP[j - 1];
    }
    if (i > 0 && j < k) {
      const x = this.ctx.lcpOf(m[i - 1], m[j]);
      dt -= x;
      dp -= pathPairs(x);
    }
    d[0] = dt;
    d[1] = dp;
  }

  /**
   * Change in (tokens, pairs) when the sorted positions `ys` join this micro-batch with members [ei, ej) gone
   * (ei = ej: none gone), in d[0], d[1]. Consecutive ys that land in the same gap (p, q) of the remaining members
   * replace the pair (p, q) by the chain p, y…, q; gaps are independent, so the sum is exact. d[2], d[3]: the
   * first and last member index next to a gap used, before the removal; when [ei, ej) lies outside them, the
   * result is the same with or without the removal.
   */
  insertion(ys: Int32Array, ei: number, ej: number, d: Float64Array): void {
    const { m } = this,
      k = m.length,
      { len, lcpOf } = this.ctx;
    let dt = 0,
      dp = 0;
    d[2] = k;
    d[3] = -1;
    for (let g = 0; g < ys.length;) {
      let lo = 0,
        hi = k;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (m[mid] < ys[g]) lo = mid + 1;
        else hi = mid;
      }
      let pi = lo - 1,
        si = lo;
      d[2] = Math.min(d[2], pi);
      d[3] = Math.max(d[3], si);
      if (pi >= ei && pi < ej) pi = ei - 1;
      if (si >= ei && si < ej) si = ej;
      const q = si < k ? m[si] : -1;
      let e = g + 1;
      while (e < ys.length && (q < 0 || ys[e] < q)) e++;
      for (let t = g; t < e; t++) {
        dt += len[ys[t]];
        dp += pathPairs(len[ys[t]]);
        if (t > g) {
          const x = lcpOf(ys[t - 1], ys[t]);
          dt -= x;
          dp -= pathPairs(x);
        }
      }
      const p = pi >= 0 ? m[pi] : -1;
      if (p >= 0) {
        const x = lcpOf(p, ys[g]);
        dt -= x;
        dp -= pathPairs(x);
      }
      if (q >= 0) {
        const x = lcpOf(ys[e - 1], q);
        dt -= x;
        dp -= pathPairs(x);
      }
      if (p >= 0 && q >= 0) {
        const x = lcpOf(p, q);
        dt += x;
        dp += pathPairs(x);
      }
      g = e;
    }
    d[0] = dt;
    d[1] = dp;
  }
}

/** Members [i, j) of `a` replaced by the sorted positions `ys`, in sorted order. */
function replaced(a: Int32Array, i: number, j: number, ys: Int32Array): Int32Array {
  const rest = new Int32Array(a.length - (j - i) + ys.length);
  rest.set(a.subarray(0, i));
  rest.set(a.subarray(j), i);
  rest.set(ys, a.length - (j - i));
  return rest.sort();
}

export function refineBalance(input: RefineInput): Refined {
  const { K, budget, costOf, maxTotal, rank } = input;
  const n = input.members.length;
  const bins = input.members.map((m) => new Bin(m, input));
  const costs = Float64Array.from(bins, (b) => costOf(b.tokens, b.pairs));
  const loads = new Float64Array(K);
  for (let b = 0; b < n; b++) loads[rank[b]] += costs[b];
  let total = bins.reduce((s, b) => s + b.tokens, 0);
  let moves = 0,
    work = 0;
  const dA = new Float64Array(2),
    dB = new Float64Array(4),
    dC = new Float64Array(4),
    dD = new Float64Array(2),
    intoC = new Float64Array(4);
  // Per unit v of every micro-batch c: its insertion into micro-batch a (4 numbers, as Bin.insertion writes them).
  const intoA: Float64Array[] = new Array<Float64Array>(n);
  const untouched = (d: Float64Array, at: number, i: number, j: number) => d[at + 3] < i || d[at + 2] >= j;
  const byLoad = new Int32Array(K);

  while (work < MAX_WORK) {
    for (let r = 0; r < K; r++) byLoad[r] = r;
    byLoad.sort((x, y) => loads[y] - loads[x] || x - y);
    const hi = byLoad[0],
      maxLoad = loads[hi];
    let sum = 0;
    for (let r = 0; r < K; r++) sum += loads[r];
    if (maxLoad * K <= (1 + TOLERANCE) * sum) break;
    // The largest load apart from ranks hi and r (K > 2).
    const otherMax = (r: number) => loads[byLoad[1] === r ? byLoad[2] : byLoad[1]];
    const pick: { best: Candidate | null; key: number[] } = { best: null, key: [maxLoad, maxLoad, Infinity] };
    const consider = (a: number, u: Unit, c: number, v: Unit | null, ta: number, pa: number, tc: number, pc: number) => {
      if (ta > budget || tc > budget) return;
      const newTotal = total - bins[a].tokens - bins[c].tokens + ta + tc;
      if (newTotal > maxTotal) return;
      const ca = costOf(ta, pa),
        cc = costOf(tc, pc),
        r = rank[c];
      const lh = loads[hi] - costs[a] + ca,
        lr = loads[r] - costs[c] + cc;
      const pairMax = Math.max(lh, lr);
      if (!(pairMax < maxLoad * (1 - 1e-12))) return;
      const globalMax = K > 2 ? Math.max(pairMax, otherMax(r)) : pairMax;
      const newSum = sum - costs[a] - costs[c] + ca + cc;
      // Imbalance max ÷ mean must not rise: a move that saves tokens elsewhere could lower the mean faster than the max.
      if (globalMax * sum > maxLoad * newSum * (1 + 1e-12)) return;
      // Lowest new maximum, then lowest pair maximum, then fewest tokens; ties keep the first in scan order.
      const key = [globalMax, pairMax, newTotal];
      for (let x = 0; x < 3; x++) {
        if (key[x] < pick.key[x]) break;
        if (key[x] > pick.key[x] || x === 2) return;
      }
      pick.key = key;
      pick.best = { a, u, c, v, ta, pa, tc, pc };
    };
    scan: for (let a = 0; a < n; a++) {
      if (rank[a] !== hi) continue;
      const A = bins[a];
      const swaps = (c: number) => A.units().length * bins[c].units().length <= MAX_SWAP_PAIRS;
      for (let c = 0; c < n; c++) {
        if (rank[c] === hi || !swaps(c)) continue;
        const C = bins[c],
          units = C.units(),
          into = (intoA[c] = new Float64Array(4 * units.length));
        units.forEach((v, k) => {
          A.insertion(C.m.subarray(v.i, v.j), 0, 0, dB);
          into.set(dB, 4 * k);
          work += v.j - v.i;
        });
      }
      for (const u of A.units()) {
        A.removal(u.i, u.j, dA);
        const xs = A.m.subarray(u.i, u.j);
        for (let c = 0; c < n; c++) {
          if (rank[c] === hi) continue;
          const C = bins[c],
            into = intoA[c];
          C.insertion(xs, 0, 0, intoC);
          work += 1 + xs.length;
          consider(a, u, c, null, A.tokens + dA[0], A.pairs + dA[1], C.tokens + intoC[0], C.pairs + intoC[1]);
          const units = swaps(c) ? C.units() : [];
          for (let k = 0; k < units.length; k++) {
            const v = units[k];
            // Most units land in a gap away from the unit they replace: then the insertion priced above holds.
            let bt = into[4 * k],
              bp = into[4 * k + 1];
            if (!untouched(into, 4 * k, u.i, u.j)) {
              A.insertion(C.m.subarray(v.i, v.j), u.i, u.j, dB);
              bt = dB[0];
              bp = dB[1];
              work += v.j - v.i;
            }
            let ct = intoC[0],
              cp = intoC[1];
            if (!untouched(intoC, 0, v.i, v.j)) {
              C.insertion(xs, v.i, v.j, dC);
              ct = dC[0];
              cp = dC[1];
              work += xs.length;
            }
            C.removal(v.i, v.j, dD);
            work++;
            consider(a, u, c, v, A.tokens + dA[0] + bt, A.pairs + dA[1] + bp, C.tokens + dD[0] + ct, C.pairs + dD[1] + cp);
          }
          if (work >= MAX_WORK) break scan;
        }
      }
    }
    if (pick.best === null) break;
    const { a, u, c, v, ta, pa, tc, pc } = pick.best;
    const A = bins[a],
      C = bins[c];
    const xs = A.m.subarray(u.i, u.j);
    const ys = v ? C.m.subarray(v.i, v.j) : new Int32Array(0);
    const nextA = new Bin(replaced(A.m, u.i, u.j, ys), input);
    const nextC = new Bin(replaced(C.m, v ? v.i : 0, v ? v.j : 0, xs), input);
    // The prices above are incremental; the rebuilt micro-batches are counted from scratch.
    if (nextA.tokens !== ta || nextA.pairs !== pa || nextC.tokens !== tc || nextC.pairs !== pc) {
      throw new TreepackError(
        'E_BACKEND',
        `balance refinement priced a move at ${ta} + ${tc} packed tokens but the micro-batches hold ${nextA.tokens} + ${nextC.tokens}`,
      );
    }
    total += ta + tc - A.tokens - C.tokens;
    bins[a] = nextA;
    bins[c] = nextC;
    for (const b of [a, c]) {
      loads[rank[b]] -= costs[b];
      costs[b] = costOf(bins[b].tokens, bins[b].pairs);
      loads[rank[b]] += costs[b];
    }
    moves++;
  }
  return {
    members: bins.map((b) => b.m),
    tokens: Float64Array.from(bins, (b) => b.tokens),
    pairs: Float64Array.from(bins, (b) => b.pairs),
    moves,
  };
}
