/**
 * Micro-batching under a token budget: which sequences of a window go into which micro-batch, on which
 * data-parallel rank.
 *
 * Sequences in lexicographic order are the leaves of the window's forest in DFS preorder, and a contiguous run
 * of them packs into exactly Σ len − Σ lcp(adjacent) nodes (the forest of the run). So if the window is cut
 * into contiguous runs, the micro-batches hold N + Σ lcp(at each cut) tokens in all, where N is the single
 * forest's size: a cut repeats exactly the prefix shared across it, and a cut between two trees repeats
 * nothing. That is tree splitting at subtree boundaries, and the whole cost of splitting is visible per cut.
 *
 * The plan: the fewest micro-batches that fit the budget (greedy, optimal for contiguous runs), rounded up to a
 * multiple of K; with K > 1, the smallest feasible maximum micro-batch cost (binary search), plus a small
 * slack; then a dynamic program over the cuts that minimises Σ lcp under both limits, so cuts fall between
 * groups and episodes, not inside shared prompts. Micro-batches are then spread over the ranks (balance.ts),
 * and with K > 1 a refinement moves whole subtrees between micro-batches of different ranks where contiguous runs
 * cannot balance them (refine.ts), within a bound on the extra packed tokens (`balanceSlack`).
 * Every sequence goes whole into one micro-batch, so each (sequence, token) occurrence is trainable in exactly
 * one of them.
 */
import { TreepackError, argError } from '../errors.js';
import { assignRanks, checkCostModel, DEFAULT_COST, imbalance, microBatchCost, pathPairs, stepsByCost, type CostModel } from './balance.js';
import type { Sequences } from './contract.js';
import { sortSequences } from './forest.js';
import { lcpQuery } from './lcp.js';
import {
  checkPlannerOptions,
  choosePlan,
  DEFAULT_KV_BYTES_PER_TOKEN,
  DEFAULT_LINK_BYTES_PER_TOKEN,
  type Built,
  type StepChoice,
} from './planner.js';
import { planPrefixRuns, type PrefixOp, type PrefixPlanStats } from './prefix.js';
import { refineBalance } from './refine.js';
import { validateSequences } from './validate.js';

/** How planMicroBatches cuts a window: the token budget, ranks, padding, cost model and prefix reuse. */
export interface BudgetOptions {
  /** most packed tokens of a micro-batch, padding included */
  maxTokens: number;
  /** data-parallel ranks: the number of micro-batches is a multiple of it; default 1 */
  dp?: number;
  /**
   * pad every micro-batch's packed length (with prefix reuse: its computed nodes past the cached prefix) to a multiple
   * of this; default 1 (no padding)
   */
  padMultiple?: number;
  cost?: CostModel;
  /** with dp > 1, move subtrees between micro-batches of different ranks to lower the slowest rank; default true */
  refine?: boolean;
  /**
   * Packed tokens the refinement may add, as a fraction of the contiguous plan's; default 0.01. When T is at least
   * 4× the longest sequence (the 5%-of-optimum goal applies), the refined plan stays within 5% of the single-forest
   * optimum if the contiguous plan is, and adds nothing if the contiguous plan is not but the goal is reachable with
   * that many micro-batches (beyond it only when each must repeat a common prompt that alone breaks the 5%).
   */
  balanceSlack?: number;
  /**
   * Prefix reuse (src/pack/prefix.ts): micro-batches may hang from a prefix an earlier micro-batch of their rank
   * cached, holding at most this many prefix tokens per rank; maxTokens then bounds the tokens each computes (its
   * forest less the cached chain), and a sequence may be longer than maxTokens. Off when absent.
   */
  prefixCacheTokens?: number;
  /** bytes one cached prefix token costs (keys, values and their gradients over all layers), for the plan's report */
  prefixBytesPerToken?: number;
  /**
   * with prefix reuse and dp > 1: a prefix held by several ranks is computed once per data-parallel group, in shares
   * (docs/design.md §11); default true
   */
  sharedPrefix?: boolean;
  /**
   * with prefix reuse: the most ranks of a context-parallel group the planner may use (a divisor of dp); default 1
   * (none). Each rank of a group of G computes 1/G of micro-batches of up to G·maxTokens computed tokens and holds 1/G
   * of up to G·prefixCacheTokens cached ones.
   */
  cp?: number;
  /** bytes of keys and values of one token over all layers, for the planner's cost of exchanges (planner.ts) */
  kvBytesPerToken?: number;
  /** bytes a link moves while a rank computes one token (forward and backward), for the planner's cost model */
  linkBytesPerToken?: number;
}

/** A prefix piece computed in shares (docs/design.md §11): depths [start, end) of a sequence's root path. */
export interface PlannedSharedPiece {
  /** index of a window sequence (input order) whose root path holds the piece */
  sequence: number;
  start: number;
  end: number;
  /** the ranks holding it, ascending and contiguous */
  ranks: number[];
  /** per rank of `ranks`: the depth range it computes */
  ranges: [number, number][];
}

/** One planned micro-batch: its sequences, tokens, rank and step (and its step-plan entry with prefix reuse). */
export interface MicroBatchPlan {
  /** indices of the window's sequences, ascending (input order) */
  sequences: Int32Array;
  rank: number;
  /** step on its rank, 0-based */
  step: number;
  naiveTokens: number;
  /** packed tokens including padTokens */
  packedTokens: number;
  padTokens: number;
  /** attention pairs under the tree mask, padding included */
  attentionPairs: number;
  cost: number;
  /** with prefix reuse: the micro-batch's stack operations (its first prefix.tokens nodes are cached) */
  prefix?: PrefixOp;
  /**
   * with prefix reuse: tokens it computes with grad (packedTokens − prefix.tokens, padding included), and the prefix
   * tokens pushed before it
   */
  computedTokens?: number;
  pushedTokens?: number;
  /** under context parallelism: the ranks that run it together (`rank` is the first) */
  cpRanks?: number[];
}

/** The plan of a window: its micro-batches, step-major, and the figures the manifest reports. */
export interface Plan {
  /** step-major: step 0 of ranks 0..K-1, then step 1, … */
  microBatches: MicroBatchPlan[];
  /** packed tokens of the window as one forest: the lower bound of any split */
  optimumTokens: number;
  rankCosts: Float64Array;
  /** max ÷ mean of rankCosts */
  imbalance: number;
  /** units moved or swapped between micro-batches by the balancing refinement (0 without it) */
  moves: number;
  /** with prefix reuse: tokens computed, pushed and cached */
  prefixReuse?: PrefixPlanStats;
  /** with shared prefixes: the pieces, referred to by index from the micro-batches' `prefix.shared` */
  sharedPrefixes?: PlannedSharedPiece[];
  /** with prefix reuse: the parallel planner's choice for this window and the candidates it weighed */
  choice?: StepChoice;
}

const positiveInt = (name: string, v: unknown): number => {
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 1) throw argError(name, 'an integer >= 1', v);
  return v;
};

const roundUp = (x: number, m: number): number => Math.ceil(x / m) * m;

/** Checks the options against the window's longest sequence; returns it and the unpadded per-micro-batch budget. */
function tokenBudget(seqOffsets: Int32Array, opts: BudgetOptions, ids?: readonly string[]): { B: number; longest: number } {
  const T = positiveInt('maxTokens', opts.maxTokens);
  const P = positiveInt('padMultiple', opts.padMultiple ?? 1);
  if (P > T) throw new TreepackError('E_ARG', `pad multiple ${P} is larger than the token budget ${T}: no micro-batch could hold a token`);
  let longest = 0,
    at = -1;
  for (let i = 0; i + 1 < seqOffsets.length; i++) {
    const len = seqOffsets[i + 1] - seqOffsets[i];
    if (len > longest) [longest, at] = [len, i];
  }
  const need = roundUp(longest, P);
  if (need > T) {
    const what = P > 1 ? `${longest} tokens, ${need} padded to a multiple of ${P}` : `${longest} tokens`;
    throw new TreepackError(
      'E_ARG',
      `the token budget ${T} is smaller than the longest sequence (${what}); a sequence is never split, so use a budget of at least ${need}`,
      ids ? { record: ids[at] } : {},
    );
  }
  // roundUp(n, P) <= T exactly when n <= floor(T / P)·P.
  return { B: Math.floor(T / P) * P, longest };
}

/** Slack on the smallest feasible maximum cost: room for the cut program to move cuts to shallow points. */
const COST_SLACK = 0.03;
export const DEFAULT_BALANCE_SLACK = 0.01;
/** The packed-token goal: within 5% of the single forest whenever T is at least 4× the longest sequence. */
const GOAL_RATIO = 1.05;
const GOAL_BUDGET_FACTOR = 4;
/** The cut program keeps one choice per (micro-batch, sequence); past this many it falls back to greedy cuts. */
const MAX_DP_CELLS = 1 << 24;

/** Sorted sequences with prefix sums, so any contiguous run's packed tokens and pairs cost O(1). */
export class Runs {
  readonly S: number;
  readonly order: Int32Array;
  readonly lcp: Int32Array;
  /** sequence length by sorted position */
  readonly seqLen: Int32Array;
  private readonly len: Float64Array; // prefix sums over sorted positions
  private readonly shared: Float64Array;
  private readonly lenPairs: Float64Array;
  private readonly sharedPairs: Float64Array;
  constructor(
    seqs: Sequences,
    private readonly cost: CostModel,
  ) {
    const { order, lcp } = sortSequences(seqs);
    const S = (this.S = order.length);
    this.order = order;
    this.lcp = lcp;
    this.len = new Float64Array(S + 1);
    this.shared = new Float64Array(S + 1);
    this.lenPairs = new Float64Array(S + 1);
    this.sharedPairs = new Float64Array(S + 1);
    this.seqLen = new Int32Array(S);
    for (let k = 0; k < S; k++) {
      const L = (this.seqLen[k] = seqs.offsets[order[k] + 1] - seqs.offsets[order[k]]);
      this.len[k + 1] = this.len[k] + L;
      this.lenPairs[k + 1] = this.lenPairs[k] + pathPairs(L);
      this.shared[k + 1] = this.shared[k] + lcp[k];
      this.sharedPairs[k + 1] = this.sharedPairs[k] + pathPairs(lcp[k]);
    }
  }
  /** packed tokens of sorted run [i, j), j > i */
  tokens(i: number, j: number): number {
    return this.len[j] - this.len[i] - (this.shared[j] - this.shared[i + 1]);
  }
  pairs(i: number, j: number): number {
    return this.lenPairs[j] - this.lenPairs[i] - (this.sharedPairs[j] - this.sharedPairs[i + 1]);
  }
  costOf(i: number, j: number): number {
    return microBatchCost(this.tokens(i, j), this.pairs(i, j), this.cost);
  }
  fits(i: number, j: number, B: number, U: number): boolean {
    return this.tokens(i, j) <= B && this.costOf(i, j) <= U;
  }
  /** Cuts as late as the limits allow: the fewest runs (optimal for contiguous runs); Infinity if one sequence alone is over U. */
  greedy(B: number, U: number): number[] {
    const cuts: number[] = [];
    for (let i = 0; i < this.S;) {
      if (!this.fits(i, i + 1, B, U)) return [Infinity];
      let j = i + 1;
      while (j < this.S && this.fits(i, j + 1, B, U)) j++;
      cuts.push(j);
      i = j;
    }
    return cuts;
  }
}

/**
 * Run ends (ascending, last = S) of at most n runs within the limits, minimising Σ lcp at the cuts. Feasible
 * run starts for a given end form a window [lo(j), j) moving right with j, so each layer is a sliding-window
 * minimum.
 */
function cheapestCuts(runs: Runs, n: number, B: number, U: number): number[] {
  const S = runs.S;
  if (n * (S + 1) > MAX_DP_CELLS) return runs.greedy(B, U);
  const lo = new Int32Array(S + 1);
  for (let j = 1, i = 0; j <= S; j++) {
    while (!runs.fits(i, j, B, U)) i++;
    lo[j] = i;
  }
  const cutCost = (i: number) => (i > 0 ? runs.lcp[i] : 0);
  let prev = new Float64Array(S + 1).fill(Infinity);
  prev[0] = 0;
  let cur = new Float64Array(S + 1);
  const from: Int32Array[] = [];
  const deque = new Int32Array(S + 1);
  let bestC = -1,
    best = Infinity;
  for (let c = 1; c <= n; c++) {
    const choice = new Int32Array(S + 1).fill(-1);
    cur.fill(Infinity);
    let head = 0,
      tail = 0;
    for (let j = 1; j <= S; j++) {
      const i = j - 1;
      const g = prev[i] + cutCost(i);
      while (tail > head && prev[deque[tail - 1]] + cutCost(deque[tail - 1]) >= g) tail--;
      deque[tail++] = i;
      while (deque[head] < lo[j]) head++;
      const k = deque[head];
      cur[j] = prev[k] + cutCost(k);
      choice[j] = k;
    }
    from.push(choice);
    // Among equally cheap plans the one with more runs spreads the work more evenly.
    if (cur[S] <= best && cur[S] < Infinity) [best, bestC] = [cur[S], c];
    [prev, cur] = [cur, prev];
  }
  if (bestC < 0) return runs.greedy(B, U);
  const ends: number[] = [];
  for (let c = bestC, j = S; c >= 1; c--) {
    ends.push(j);
    j = from[c - 1][j];
  }
  return ends.reverse();
}

/**
 * Plans the micro-batches of one window of sequences (CSR, input order). `ids` name sequences in error
 * messages.
 */
export function planMicroBatches(seqs: Sequences, opts: BudgetOptions, ids?: readonly string[]): Plan {
  validateSequences(seqs);
  const K = positiveInt('dp', opts.dp ?? 1);
  const P = opts.padMultiple ?? 1;
  const cost = opts.cost ?? DEFAULT_COST;
  checkCostModel(cost);
  const slack = opts.balanceSlack ?? DEFAULT_BALANCE_SLACK;
  if (typeof slack !== 'number' || !Number.isFinite(slack) || slack < 0) throw argError('balanceSlack', 'a finite number >= 0', slack);
  if (opts.prefixCacheTokens !== undefined) return planWithPrefix(seqs, opts, K, cost, ids);
  if ((opts.cp ?? 1) !== 1)
    throw argError('cp', '1 without prefix reuse (context parallelism plans step plans: give prefixCacheTokens)', opts.cp);
  const { B, longest } = tokenBudget(seqs.offsets, opts, ids);
  const runs = new Runs(seqs, cost);
  const S = runs.S;
  const optimumTokens = S > 0 ? runs.tokens(0, S) : 0;
  if (S === 0) return { microBatches: [], optimumTokens, rankCosts: new Float64Array(K), imbalance: 1, moves: 0 };

  const n = roundUp(runs.greedy(B, Infinity).length, K);
  let U = Infinity;
  if (K > 1) {
    // The smallest maximum run cost with at most n runs: feasibility is monotone in the limit.
    let hi = runs.costOf(0, S),
      lo = 0;
    for (let k = 0; k < S; k++) lo = Math.max(lo, runs.costOf(k, k + 1));
    if (runs.greedy(B, lo).length > n) {
      for (let it = 0; it < 60 && hi - lo > 1e-9 * hi; it++) {
        const mid = (lo + hi) / 2;
        if (runs.greedy(B, mid).length <= n) hi = mid;
        else lo = mid;
      }
    } else hi = lo;
    U = hi * (1 + COST_SLACK);
  }
  const ends = cheapestCuts(runs, n, B, U);

  // Members as sorted positions; runs past the last end stay empty: every rank still runs the same number of steps.
  let members: Int32Array[] = [];
  let tokens: Float64Array = new Float64Array(n);
  let pairs: Float64Array = new Float64Array(n);
  for (let b = 0, start = 0; b < n; b++) {
    const end = b < ends.length ? ends[b] : start;
    members.push(Int32Array.from({ length: end - start }, (_, k) => start + k));
    if (end > start) [tokens[b], pairs[b]] = [runs.tokens(start, end), runs.pairs(start, end)];
    start = end;
  }
  // A pad node is a root: it sees itself only.
  const padOf = (t: number) => roundUp(t, P) - t;
  const costOf = (t: number, p: number) => microBatchCost(t + padOf(t), p + padOf(t), cost);
  const costsOf = () => Float64Array.from(tokens, (t, b) => costOf(t, pairs[b]));
  const { rank } = assignRanks(costsOf(), K);
  let moves = 0;
  if (K > 1 && opts.refine !== false) {
    const contiguous = tokens.reduce((a, t) => a + t, 0);
    let maxTotal = Math.floor(contiguous * (1 + slack));
    if (opts.maxTokens >= GOAL_BUDGET_FACTOR * longest) {
      // The packed-token goal applies. Kept where the contiguous plan meets it; where it does not, no tokens may be
      // added unless the goal is out of reach anyway: m non-empty micro-batches each repeat the prefix common to
      // every sequence (a shared system prompt), so they hold at least optimum + (m − 1)·common tokens.
      const goal = Math.floor(GOAL_RATIO * optimumTokens);
      let common = S > 1 ? Infinity : 0,
        nonEmpty = 0;
      for (let k = 1; k < S; k++) common = Math.min(common, runs.lcp[k]);
      for (const m of members) if (m.length > 0) nonEmpty++;
      const floor = optimumTokens + (nonEmpty - 1) * common;
      if (contiguous <= goal) maxTotal = Math.min(maxTotal, goal);
      else if (floor <= goal) maxTotal = contiguous;
    }
    const refined = refineBalance({ len: runs.seqLen, lcpOf: lcpQuery(runs.lcp), members, rank, K, budget: B, costOf, maxTotal });
    ({ members, tokens, pairs, moves } = refined);
  }
  const costs = costsOf();
  const loads = new Float64Array(K);
  for (let b = 0; b < n; b++) loads[rank[b]] += costs[b];
  const step = stepsByCost(costs, rank, K);
  const microBatches: MicroBatchPlan[] = new Array<MicroBatchPlan>(n);
  for (let b = 0; b < n; b++) {
    const sequences = Int32Array.from(members[b], (k) => runs.order[k]).sort();
    let naive = 0;
    for (const i of sequences) naive += seqs.offsets[i + 1] - seqs.offsets[i];
    const pad = padOf(tokens[b]);
    microBatches[step[b] * K + rank[b]] = {
      sequences,
      rank: rank[b],
      step: step[b],
      naiveTokens: naive,
      packedTokens: tokens[b] + pad,
      padTokens: pad,
      attentionPairs: pairs[b] + pad,
      cost: costs[b],
    };
  }
  return { microBatches, optimumTokens, rankCosts: loads, imbalance: imbalance(loads), moves };
}

/**
 * The fewest tokens any data-parallel plan of `seqs` can compute with grad, given the ranks `plan` gives sequences to:
 * every such rank computes the prefix all sequences share (a common system prompt) at least once, and the rest of
 * the forest is computed at least once somewhere, so optimum + (ranks − 1)·common. Only keys/values sent between
 * ranks could go below it.
 */
export function dpFloorTokens(seqs: Sequences, plan: Plan): number {
  const S = seqs.offsets.length - 1;
  const ranks = new Set(plan.microBatches.filter((m) => m.sequences.length > 0).map((m) => m.rank)).size;
  if (S < 2 || ranks < 2) return plan.optimumTokens;
  const first = seqs.offsets[0];
  let common = seqs.offsets[1] - first;
  for (let i = 1; i < S && common > 0; i++) {
    const a = seqs.offsets[i];
    const limit = Math.min(common, seqs.offsets[i + 1] - a);
    let k = 0;
    while (k < limit && seqs.tokens[a + k] === seqs.tokens[first + k]) k++;
    common = k;
  }
  return plan.optimumTokens + (ranks - 1) * common;
}

/**
 * planMicroBatches with prefix reuse: the cut and stack operations of src/pack/prefix.ts, ranks padded to equal steps
 * with empty micro-batches, made each way the parallel planner weighs (planner.ts) and the fastest kept. With
 * padMultiple P, a micro-batch's computed nodes (the ones past its cached prefix, what its forward runs) are padded to
 * a multiple of P: the cut is planned under floor(T / P)·P computed tokens per rank, so computed plus padding stays
 * within T. Pushed and popped segments are not padded.
 */
function planWithPrefix(seqs: Sequences, opts: BudgetOptions, K: number, cost: CostModel, ids?: readonly string[]): Plan {
  const T = positiveInt('maxTokens', opts.maxTokens);
  const P = positiveInt('padMultiple', opts.padMultiple ?? 1);
  if (P > T) throw new TreepackError('E_ARG', `pad multiple ${P} is larger than the token budget ${T}: no micro-batch could hold a token`);
  const B = Math.floor(T / P) * P;
  const share = opts.sharedPrefix ?? true;
  if (typeof share !== 'boolean') throw argError('sharedPrefix', 'a boolean', share);
  const planner = {
    dp: K,
    cpMax: opts.cp ?? 1,
    share,
    kvBytesPerToken: opts.kvBytesPerToken ?? DEFAULT_KV_BYTES_PER_TOKEN,
    linkBytesPerToken: opts.linkBytesPerToken ?? DEFAULT_LINK_BYTES_PER_TOKEN,
  };
  checkPlannerOptions(planner);
  const runs = new Runs(seqs, cost);
  const S = runs.S;
  const optimumTokens = S > 0 ? runs.tokens(0, S) : 0;
  if (S === 0) {
    const prefixReuse = {
      computedTokens: 0,
      pushedTokens: 0,
      peakCachedTokens: 0,
      ...(opts.prefixBytesPerToken !== undefined && { peakCachedBytes: 0 }),
    };
    return { microBatches: [], optimumTokens, rankCosts: new Float64Array(K), imbalance: 1, moves: 0, prefixReuse };
  }
  const { plan, choice } = choosePlan(planner, (mode, G) =>
    buildWithPrefix(seqs, runs, { ...opts, share: mode === 'shared', B, P, K, G, kvBytes: planner.kvBytesPerToken }, cost, ids),
  );
  return { ...plan, optimumTokens, choice };
}

/**
 * One candidate of the planner: the prefix plan over K / G groups of G ranks (G = 1: plain ranks), each group with
 * G·B computed tokens per micro-batch and G·C cached prefix tokens; its micro-batches are step-major with K / G per
 * step, a group's on its first rank (`cpRanks` naming all of them when G > 1). Loads and bytes are per rank.
 */
function buildWithPrefix(
  seqs: Sequences,
  runs: Runs,
  o: BudgetOptions & { share: boolean; B: number; P: number; K: number; G: number; kvBytes: number },
  cost: CostModel,
  ids?: readonly string[],
): Built<Omit<Plan, 'optimumTokens'>> {
  const { B, P, K, G } = o;
  const groups = K / G;
  const planned = planPrefixRuns(
    runs,
    B * G,
    groups,
    cost,
    { cacheTokens: o.prefixCacheTokens! * G, bytesPerToken: o.prefixBytesPerToken, share: o.share },
    ids,
  );
  const perGroup = new Int32Array(groups);
  for (const p of planned.runs) perGroup[p.rank]++;
  const steps = Math.max(1, ...perGroup);
  const loads = new Float64Array(K);
  const bytes = new Float64Array(K);
  const spread = (g: number, load: number, moved: number) => {
    for (let r = g * G; r < (g + 1) * G; r++) [loads[r], bytes[r]] = [loads[r] + load / G, bytes[r] + moved];
  };
  planned.shareLoad.forEach((l, g) => spread(g, l, 0));
  for (const piece of planned.shared) {
    piece.ranks.forEach((r, i) => (bytes[r] += 3 * (piece.end - piece.start - (piece.ranges[i][1] - piece.ranges[i][0])) * o.kvBytes));
  }
  const microBatches: MicroBatchPlan[] = new Array<MicroBatchPlan>(steps * groups);
  const cpRanks = (g: number) => (G > 1 ? { cpRanks: Array.from({ length: G }, (_, k) => g * G + k) } : {});
  let pads = 0;
  for (const p of planned.runs) {
    const sequences = Int32Array.from({ length: p.hi - p.lo }, (_, k) => runs.order[p.lo + k]).sort();
    let naive = 0;
    for (const i of sequences) naive += seqs.offsets[i + 1] - seqs.offsets[i];
    const pad = roundUp(p.computed, P) - p.computed;
    pads += pad;
    // Under CP a rank receives (G − 1)/G of the K/V its group computes: twice for the micro-batch, three times for a push.
    spread(p.rank, p.cost, ((G - 1) / G) * (2 * (p.computed + pad) + 3 * p.pushedTokens) * o.kvBytes);
    microBatches[p.step * groups + p.rank] = {
      sequences,
      rank: p.rank * G,
      step: p.step,
      naiveTokens: naive,
      packedTokens: runs.tokens(p.lo, p.hi) + pad,
      padTokens: pad,
      attentionPairs: p.pairs + pad,
      cost: p.cost,
      prefix: p.op,
      computedTokens: p.computed + pad,
      pushedTokens: p.pushedTokens,
      ...cpRanks(p.rank),
    };
  }
  for (let b = 0; b < microBatches.length; b++) {
    microBatches[b] ??= {
      sequences: new Int32Array(0),
      rank: (b % groups) * G,
      step: Math.floor(b / groups),
      naiveTokens: 0,
      packedTokens: 0,
      padTokens: 0,
      attentionPairs: 0,
      cost: 0,
      prefix: { tokens: 0, push: [], release: 0, ...(planned.shared.length > 0 && { shared: [] }) },
      computedTokens: 0,
      pushedTokens: 0,
      ...cpRanks(b % groups),
    };
  }
  const prefixReuse = { ...planned.stats, computedTokens: planned.stats.computedTokens + pads };
  const sharedPrefixes = planned.shared.map(({ rep, ...p }) => ({ sequence: runs.order[rep], ...p }));
  const plan = {
    microBatches,
    rankCosts: loads,
    imbalance: imbalance(loads),
    moves: 0,
    prefixReuse,
    ...(sharedPrefixes.length > 0 && { sharedPrefixes }),
  };
  return { plan, computed: prefixReuse.computedTokens, loads, bytes };
}
