/**
 * The cost model of a packed micro-batch and the assignment of micro-batches to data-parallel ranks.
 *
 * Cost = a·(packed tokens) + b·(attention pairs). A token's dense work (projections, MLP) is linear in the
 * packed length; attention work is one query-key product per pair the tree mask lets through, and under the
 * rule `k <= q < subtree_end[k]` query q sees exactly its depth+1 ancestors-or-self, so the pairs are
 * Σ (position_ids + 1), an O(N) sum with no mask built.
 */
import { argError } from '../errors.js';

/** Cost coefficients, in units of one token's dense work. */
export interface CostModel {
  /** per packed token */
  a: number;
  /** per (query, key) pair visible under the tree mask */
  b: number;
}

/**
 * A dense decoder does about 6·P FLOPs per token (forward and backward) for P parameters, and 12·L·d FLOPs per
 * attention pair for L layers of width d, so b/a = 2·L·d/P. For a 7B model (L = 28, d = 3584, P = 7.6e9) that is
 * 2.6e-5: attention overtakes the dense work once the mean depth passes about 38k tokens.
 */
export const DEFAULT_COST: Readonly<CostModel> = { a: 1, b: 2.6e-5 };

export function checkCostModel(cost: CostModel, name = 'cost'): void {
  for (const k of ['a', 'b'] as const) {
    const v = cost?.[k];
    if (typeof v !== 'number' || !Number.isFinite(v) || v < 0) throw argError(`${name}.${k}`, 'a finite number >= 0', v);
  }
}

/** Attention pairs visible under the tree mask: Σ over nodes of depth + 1. */
export function attentionPairs(position_ids: Int32Array): number {
  let s = 0;
  for (let p = 0; p < position_ids.length; p++) s += position_ids[p] + 1;
  return s;
}

/** Attention pairs of a path of L nodes (depths 0..L-1): L(L+1)/2; a sequence alone, or its part below a shared prefix by difference. */
export const pathPairs = (L: number): number => (L * (L + 1)) / 2;

/** The cost of a micro-batch: `a` per packed token plus `b` per attention pair. */
export const microBatchCost = (tokens: number, pairs: number, cost: CostModel): number => cost.a * tokens + cost.b * pairs;

/** max ÷ mean of the per-rank loads (1 for no load at all: nothing is waiting on anything). */
export function imbalance(loads: ArrayLike<number>): number {
  let max = 0,
    sum = 0;
  for (let r = 0; r < loads.length; r++) {
    sum += loads[r];
    if (loads[r] > max) max = loads[r];
  }
  return sum > 0 ? (max * loads.length) / sum : 1;
}

/** Which rank runs each micro-batch, and the cost per rank. */
export interface RankAssignment {
  /** rank of each micro-batch */
  rank: Int32Array;
  /** step of each micro-batch within its rank: every rank runs steps 0 .. n/K - 1 */
  step: Int32Array;
  /** summed cost per rank */
  loads: Float64Array;
}

/**
 * Spreads n micro-batches (n a multiple of K) over K ranks, n/K each, minimising the slowest rank: longest
 * processing time first among ranks with a free slot, then swaps between the slowest rank and any other while
 * a swap lowers the larger of the two loads. Within a rank, steps go by decreasing cost, so step s on every rank
 * holds comparable work when ranks synchronise per micro-batch.
 */
export function assignRanks(costs: ArrayLike<number>, K: number): RankAssignment {
  const n = costs.length;
  if (!Number.isSafeInteger(K) || K < 1) throw argError('dp', 'an integer >= 1', K);
  if (n % K !== 0) throw argError('costs.length', `a multiple of dp = ${K}`, n);
  const per = n / K;
  const order = Array.from({ length: n }, (_, i) => i).sort((x, y) => costs[y] - costs[x] || x - y);
  const rank = new Int32Array(n);
  const loads = new Float64Array(K);
  const count = new Int32Array(K);
  for (const i of order) {
    let best = -1;
    for (let r = 0; r < K; r++) if (count[r] < per && (best < 0 || loads[r] < loads[best])) best = r;
    rank[i] = best;
    loads[best] += costs[i];
    count[best]++;
  }
  // Swap refinement: each accepted swap strictly lowers max(load[hi], load[r]) without raising any other rank
  // above the old maximum, so the loop terminates; the cap bounds the work on large inputs.
  for (let iter = 0; iter < 4 * n; iter++) {
    let hi = 0;
    for (let r = 1; r < K; r++) if (loads[r] > loads[hi]) hi = r;
    let bestGain = 0,
      bi = -1,
      bj = -1;
    for (let i = 0; i < n; i++) {
      if (rank[i] !== hi) continue;
      for (let j = 0; j < n; j++) {
        const r = rank[j];
        const d = costs[i] - costs[j];
        if (r === hi || d <= 0) continue;
        const newMax = Math.max(loads[hi] - d, loads[r] + d);
        const gain = loads[hi] - newMax;
        if (gain > bestGain) {
          bestGain = gain;
          bi = i;
          bj = j;
        }
      }
    }
    if (bi < 0) break;
    const d = costs[bi] - costs[bj];
    const r = rank[bj];
    loads[hi] -= d;
    loads[r] += d;
    rank[bi] = r;
    rank[bj] = hi;
  }
  return { rank, step: stepsByCost(costs, rank, K), loads };
}

/** Step of each micro-batch on its rank: by decreasing cost, ties by index. */
export function stepsByCost(costs: ArrayLike<number>, rank: Int32Array, K: number): Int32Array {
  const n = costs.length;
  const order = Array.from({ length: n }, (_, i) => i).sort((x, y) => costs[y] - costs[x] || x - y);
  const step = new Int32Array(n);
  const next = new Int32Array(K);
  for (const i of order) step[i] = next[rank[i]]++;
  return step;
}
