/**
 * Micro-batching under a token budget, per dataset, for T ∈ {8k, 32k, 128k} and K ∈ {1, 8}: total packed tokens
 * against the single-forest optimum and against two baselines run on the same sequences (naive per-sample
 * first-fit, and dedup-aware first-fit in input order as AReaL packs trees), micro-batch counts, rank imbalance
 * (max ÷ mean cost) and planning time, for the contiguous plan and the refined one (subtrees moved between
 * ranks) side by side; then the step plans with prefix reuse (a micro-batch hangs from a prefix an earlier one of its
 * rank cached): tokens computed with grad and pushed without it against the optimum, and the peak cached prefix.
 * Then the streaming collectors on simulated completion times.
 */
import { performance } from 'node:perf_hooks';
import {
  DEFAULT_COST,
  imbalance,
  lcpQuery,
  microBatchCost,
  pathPairs,
  planMicroBatches,
  simulateCollector,
  sortSequences,
  type CollectorPolicy,
  type Plan,
  type Sequences,
} from '../src/index.js';
import { rng } from '../test/helpers/sequences.js';

export interface MicroBatchRow {
  dataset: string;
  maxTokens: number;
  dp: number;
  feasible: boolean;
  optimum: number;
  longest: number;
  /** contiguous runs only (refine: false) */
  contiguous?: Result;
  /** the default plan: contiguous, then refined */
  ours?: Result;
  /** no plan with this plan's total cost can beat it: the costliest sequence alone in a micro-batch ÷ the mean rank cost */
  imbalanceBound?: number;
  firstFit?: Result;
  naive?: Result;
  /** step plan with prefix reuse (feasible at any T) */
  prefix?: PrefixResult;
}

interface PrefixResult {
  /** tokens computed with grad: micro-batches' own nodes, popped prefix segments and shared pieces, all ranks */
  computed: number;
  /** the same with each rank computing the prefixes it hangs from alone (--no-shared-prefix) */
  alone: number;
  /** the planner's choice (docs/design.md §11) */
  mode: string;
  /** tokens run without grad to fill the caches */
  pushed: number;
  peakCachedTokens: number;
  peakCachedBytes: number;
  microBatches: number;
  /** ranks given at least one micro-batch: each computes the prefix common to all sequences */
  busyRanks: number;
  imbalance: number;
  seconds: number;
}

/**
 * Bytes one cached prefix token costs on a 7B reference (Qwen2.5-7B: 28 layers, 4 KV heads of 128, bf16): its keys
 * and values, and their gradient buffers.
 */
export const REFERENCE_CACHE_BYTES_PER_TOKEN = 28 * 2 * 4 * 128 * 2 * 2;

interface Result {
  tokens: number;
  microBatches: number;
  imbalance: number;
  seconds: number;
  moves?: number;
}

/**
 * First-fit in input order. With `dedup`, a sequence costs its tokens past the longest prefix it shares with a
 * sequence already in the micro-batch (a trie per micro-batch, kept as sorted ranks with an LCP range-minimum
 * table); without, its full length. Micro-batches go to ranks round-robin, empty ones added to reach a
 * multiple of K, as a first-fit trainer does.
 */
function firstFit(seqs: Sequences, T: number, K: number, dedup: boolean): Result {
  const t0 = performance.now();
  const S = seqs.offsets.length - 1;
  const { order, lcp } = sortSequences(seqs);
  const rankOf = new Int32Array(S);
  order.forEach((s, k) => (rankOf[s] = k));
  const lcpOf = lcpQuery(lcp);
  const bins: { ranks: number[]; tokens: number }[] = [];
  for (let s = 0; s < S; s++) {
    const len = seqs.offsets[s + 1] - seqs.offsets[s],
      r = rankOf[s];
    let placed = false;
    for (const bin of bins) {
      let at = 0,
        hi = bin.ranks.length;
      while (at < hi) {
        const mid = (at + hi) >> 1;
        if (bin.ranks[mid] < r) at = mid + 1;
        else hi = mid;
      }
      let shared = 0;
      if (dedup && at > 0) shared = Math.max(shared, lcpOf(bin.ranks[at - 1], r));
      if (dedup && at < bin.ranks.length) shared = Math.max(shared, lcpOf(r, bin.ranks[at]));
      if (bin.tokens + len - shared > T) continue;
      bin.ranks.splice(at, 0, r);
      bin.tokens += len - shared;
      placed = true;
      break;
    }
    if (!placed) bins.push({ ranks: [r], tokens: len });
  }
  const seconds = (performance.now() - t0) / 1000;
  const n = Math.ceil(Math.max(1, bins.length) / K) * K;
  const loads = new Float64Array(K);
  let tokens = 0;
  bins.forEach((bin, b) => {
    let pairs = 0;
    bin.ranks.forEach((r, k) => {
      const s = order[r];
      pairs += pathPairs(seqs.offsets[s + 1] - seqs.offsets[s]) - (dedup && k > 0 ? pathPairs(lcpOf(bin.ranks[k - 1], r)) : 0);
    });
    loads[b % K] += microBatchCost(bin.tokens, pairs, DEFAULT_COST);
    tokens += bin.tokens;
  });
  return { tokens, microBatches: n, imbalance: imbalance(loads), seconds };
}

/** The plan and its fastest time of three (the first call of a size also pays for compiling the planner). */
function timedPrefixPlan(seqs: Sequences, T: number, K: number): PrefixResult {
  let seconds = Infinity,
    plan!: Plan;
  for (let rep = 0; rep < 3; rep++) {
    const t0 = performance.now();
    plan = planMicroBatches(seqs, {
      maxTokens: T,
      dp: K,
      prefixCacheTokens: 0x7fffffff,
      prefixBytesPerToken: REFERENCE_CACHE_BYTES_PER_TOKEN,
    });
    seconds = Math.min(seconds, (performance.now() - t0) / 1000);
  }
  const p = plan.prefixReuse!;
  const busy = plan.microBatches.filter((m) => m.sequences.length > 0);
  const alone = planMicroBatches(seqs, { maxTokens: T, dp: K, prefixCacheTokens: 0x7fffffff, sharedPrefix: false });
  const busyRanks = new Set(alone.microBatches.filter((m) => m.sequences.length > 0).map((m) => m.rank)).size;
  return {
    computed: p.computedTokens,
    alone: alone.prefixReuse!.computedTokens,
    mode: plan.choice!.mode,
    pushed: p.pushedTokens,
    peakCachedTokens: p.peakCachedTokens,
    peakCachedBytes: p.peakCachedBytes!,
    microBatches: busy.length,
    busyRanks,
    imbalance: plan.imbalance,
    seconds,
  };
}

function timedPlan(seqs: Sequences, T: number, K: number, refine: boolean): Result & { plan: Plan } {
  let seconds = Infinity,
    plan!: Plan;
  for (let rep = 0; rep < 3; rep++) {
    const t0 = performance.now();
    plan = planMicroBatches(seqs, { maxTokens: T, dp: K, refine });
    seconds = Math.min(seconds, (performance.now() - t0) / 1000);
  }
  const tokens = plan.microBatches.reduce((a, m) => a + m.packedTokens, 0);
  return { tokens, microBatches: plan.microBatches.length, imbalance: plan.imbalance, seconds, moves: plan.moves, plan };
}

export function benchMicroBatch(dataset: string, seqs: Sequences): MicroBatchRow[] {
  const S = seqs.offsets.length - 1;
  let longest = 0,
    costliest = 0;
  for (let i = 0; i < S; i++) {
    const L = seqs.offsets[i + 1] - seqs.offsets[i];
    longest = Math.max(longest, L);
    costliest = Math.max(costliest, microBatchCost(L, pathPairs(L), DEFAULT_COST));
  }
  const optimum = planMicroBatches(seqs, { maxTokens: Math.max(1, longest) }).optimumTokens;
  // Every non-empty micro-batch repeats the prefix common to all sequences (a shared system prompt).
  const { lcp } = sortSequences(seqs);
  let common = 0;
  if (S > 1) common = lcp.subarray(1).reduce((a, x) => Math.min(a, x), Infinity);
  console.log(`\n## micro-batching under a token budget: ${dataset}`);
  console.log(
    `  ${S} sequences, longest ${longest} tokens, single-forest optimum ${optimum.toLocaleString('en-US')} packed tokens, prefix common to all ${common} tokens`,
  );
  console.log(
    '  contiguous: sorted runs only; refined: then subtrees moved/swapped between ranks (the default). ≥: no plan of that total cost balances better (the costliest sequence alone ÷ mean); plan ms: fastest of 3',
  );
  console.log(
    '  T      K  | contiguous: ÷opt  mbs  imbal   ms | refined: tokens ÷opt  imbal (≥)    moves    ms | first-fit dedup: ÷opt  mbs  imbal   ms | naive first-fit: ÷opt  mbs  imbal',
  );
  const rows: MicroBatchRow[] = [];
  for (const T of [8192, 32768, 131072]) {
    for (const K of [1, 8]) {
      const row: MicroBatchRow = { dataset, maxTokens: T, dp: K, feasible: T >= longest, optimum, longest };
      rows.push(row);
      const label = `  ${String(T / 1024).padStart(3)}k ${String(K).padStart(2)}  |`;
      if (!row.feasible) {
        console.log(`${label} infeasible: the longest sequence has ${longest} tokens (the planner rejects T < ${longest})`);
        continue;
      }
      const { plan: _c, ...c } = timedPlan(seqs, T, K, false);
      const { plan, ...o } = timedPlan(seqs, T, K, true);
      [row.contiguous, row.ours] = [c, o];
      row.imbalanceBound = Math.max(1, (costliest * K) / plan.rankCosts.reduce((a, x) => a + x, 0));
      row.firstFit = firstFit(seqs, T, K, true);
      row.naive = firstFit(seqs, T, K, false);
      const f = (r: Result) =>
        `${(r.tokens / optimum).toFixed(3).padStart(6)} ${String(r.microBatches).padStart(4)} ${r.imbalance.toFixed(3)}`;
      const ms = (r: Result) => (r.seconds * 1e3).toFixed(1).padStart(6);
      const nonEmpty = plan.microBatches.filter((m) => m.sequences.length > 0).length;
      const floor = optimum + (nonEmpty - 1) * common;
      const tokensGoal =
        o.tokens <= 1.05 * optimum
          ? 'met'
          : floor > 1.05 * optimum
            ? `MISSED (≥ ${(floor / optimum).toFixed(3)}: ${nonEmpty} micro-batches repeat the common prefix)`
            : 'MISSED';
      const goals = [
        ...(T >= 4 * longest ? [`tokens ≤1.05×opt ${tokensGoal}`] : []),
        `imbalance ≤1.05 ${o.imbalance <= 1.05 ? 'met' : row.imbalanceBound > 1.05 ? 'MISSED (bound > 1.05)' : 'MISSED'}`,
      ];
      console.log(
        `${label}      ${f(c)} ${ms(c)} |` +
          ` ${o.tokens.toLocaleString('en-US').padStart(12)} ${(o.tokens / optimum).toFixed(3)} ${o.imbalance.toFixed(3)} (${row.imbalanceBound.toFixed(3)}) ${String(o.moves).padStart(5)} ${ms(o)} |` +
          `      ${f(row.firstFit)} ${ms(row.firstFit)} |      ${f(row.naive)}  goals: ${goals.join(', ')}`,
      );
    }
  }
  console.log(
    `\n  step plans with prefix reuse (${dataset}): computed = tokens run with grad (micro-batches' own nodes + popped prefix segments + shared pieces, all ranks), pushed = run without grad to fill the caches;`,
  );
  console.log(
    '  alone: each rank computes the prefixes it hangs from (--no-shared-prefix); shared: the planner’s plan (docs/design.md §11), a prefix several ranks hang from computed once, in shares;',
  );
  console.log(
    `  peak cached = most prefix tokens a rank holds, bytes at ${(REFERENCE_CACHE_BYTES_PER_TOKEN / 1024).toFixed(0)} KiB/token (7B reference: K, V and their gradients, bf16)`,
  );
  console.log(
    '  T      K  | alone ÷opt  computed ÷opt  mode    pushed ÷opt | peak cached tokens      bytes | mbs  imbal     ms | plain split ÷opt',
  );
  const floorOf = (ranks: number) => optimum + (ranks - 1) * common;
  // The rank counts of the plain table, and 2 (where the cost of sharing a prefix between two ranks shows).
  for (const T of [8192, 32768, 131072]) {
    if (!rows.some((x) => x.maxTokens === T && x.dp === 2))
      rows.splice(
        rows.findIndex((x) => x.maxTokens === T && x.dp === 8),
        0,
        { dataset, maxTokens: T, dp: 2, feasible: T >= longest, optimum, longest },
      );
  }
  for (const row of rows) {
    const p = (row.prefix = timedPrefixPlan(seqs, row.maxTokens, row.dp));
    const plain = row.ours ? (row.ours.tokens / optimum).toFixed(3) : row.dp === 2 ? '—' : 'infeasible';
    const gib = p.peakCachedBytes / 2 ** 30;
    console.log(
      `  ${String(row.maxTokens / 1024).padStart(3)}k ${String(row.dp).padStart(2)}  |` +
        `      ${(p.alone / optimum).toFixed(3)}          ${(p.computed / optimum).toFixed(3)}  ${p.mode.padEnd(6)}       ${(p.pushed / optimum).toFixed(3)} |` +
        ` ${String(p.peakCachedTokens).padStart(18)} ${(gib < 1 ? `${(gib * 1024).toFixed(0)} MiB` : `${gib.toFixed(2)} GiB`).padStart(10)} |` +
        ` ${String(p.microBatches).padStart(3)} ${p.imbalance.toFixed(3)} ${(p.seconds * 1e3).toFixed(1).padStart(6)} | ${plain.padStart(10)}` +
        `  goal: computed ≤1.05×opt ${p.computed <= 1.05 * optimum ? 'met' : p.mode !== 'shared' && floorOf(p.busyRanks) > 1.05 * optimum ? `MISSED (≥ ${(floorOf(p.busyRanks) / optimum).toFixed(3)}: the planner chose ${p.mode}, and ${p.busyRanks} busy ranks each compute the common prefix)` : 'MISSED'}`,
    );
  }
  return rows;
}

/**
 * 1024 groups submitted at a steady rate with heavy-tailed generation times (log-normal, σ = 1: a few groups
 * take 10× the median, as long agent episodes do), trained 32 groups per batch.
 */
export function benchCollectors(): { policy: string; meanStaleness: number; maxStaleness: number; meanWait: number }[] {
  const r = rng(11);
  const groups = Array.from({ length: 1024 }, (_, i) => {
    const u = Math.max(1e-12, r()),
      v = r();
    const gen = Math.exp(Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v));
    return { submitted: i * 0.05, completed: i * 0.05 + gen };
  });
  console.log('\n## streaming collectors: 1024 groups, log-normal generation time (median 1), 32 groups per batch');
  const out = [];
  const policies: [string, CollectorPolicy][] = [
    ['windowed FIFO W=32', { kind: 'windowed-fifo', window: 32 }],
    ['windowed FIFO W=64', { kind: 'windowed-fifo', window: 64 }],
    ['windowed FIFO W=256', { kind: 'windowed-fifo', window: 256 }],
    ['fully async', { kind: 'async' }],
  ];
  for (const [policy, p] of policies) {
    const s = simulateCollector(p, groups, 32);
    console.log(
      `  ${policy.padEnd(20)} staleness mean ${s.meanStaleness.toFixed(2)} max ${s.maxStaleness}, finished group waits ${s.meanWait.toFixed(2)} on average`,
    );
    out.push({ policy, meanStaleness: s.meanStaleness, maxStaleness: s.maxStaleness, meanWait: s.meanWait });
  }
  return out;
}
