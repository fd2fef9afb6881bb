/**
 * The parallel planner (docs/design.md §11): per step (one window of the packer), a step plan with prefix reuse is
 * made three ways and the fastest by the cost model is kept, with the figures that decided it.
 *
 * - `dp`: every rank runs its micro-batches alone; a prefix whose branches train on several ranks is computed by each.
 * - `shared`: such a prefix is computed once per data-parallel group, in shares (share.ts): each rank of its group
 *   computes a range, the group exchanges the K/V and returns the gradients.
 * - `cp` over G ranks (G divides dp, 2 ≤ G ≤ `--cp`): the ranks form dp/G context-parallel groups; each group runs a
 *   micro-batch of up to G·T computed tokens and a cached prefix of up to G·C tokens, each rank computing 1/G of
 *   them, exchanging K/V per layer. It is how a tree whose cached chain does not fit one rank trains at all.
 *
 * Cost model, in the units of the micro-batch cost (one token's dense forward and backward): a rank's time is its
 * compute load (balance.ts, prefix.ts) plus the bytes it receives divided by `linkBytesPerToken` (bytes a link moves
 * while a rank computes one token), no overlap assumed. Bytes, from `kvBytesPerToken` (keys and values of one token
 * over all layers): a shared piece of L tokens moves 3·(L − own range) per member (its K/V gathered for the push and
 * again for the recompute with grad, its K/V gradients reduced to their owners); under CP a micro-batch's computed
 * tokens move 2·(G − 1)/G of their K/V per rank (gathered forward, gradients reduced backward) and its pushed prefix
 * segments 3·(G − 1)/G. Ties go to fewer computed tokens, then to the simpler mode (dp, shared, cp).
 */
import { TreepackError, argError } from '../errors.js';

/** How a step's ranks share its work: each alone, prefixes computed in shares, or context-parallel groups. */
export type ParallelMode = 'dp' | 'shared' | 'cp';

/** What one way of planning a step would cost, or why it cannot be used. */
export interface CandidateReport {
  mode: ParallelMode;
  /** ranks per context-parallel group (1 for dp and shared) */
  cp: number;
  computed_tokens?: number;
  /** the slowest rank's compute load */
  max_rank_cost?: number;
  /** the most bytes one rank receives */
  max_rank_bytes?: number;
  /** max over ranks of load + bytes ÷ linkBytesPerToken: what the choice minimises */
  time?: number;
  /** why this way cannot train the step */
  refused?: string;
}

/** The planner's choice for a step and the candidates it weighed. */
export interface StepChoice {
  mode: ParallelMode;
  cp: number;
  why: string;
  candidates: CandidateReport[];
}

export interface PlannerOptions {
  dp: number;
  /** the most ranks of a context-parallel group; 1: no context parallelism */
  cpMax: number;
  /** whether `shared` may be chosen */
  share: boolean;
  kvBytesPerToken: number;
  linkBytesPerToken: number;
}

/**
 * Bytes of keys and values of one token over all layers on a 7B reference (Qwen2.5-7B: 28 layers, 4 KV heads of
 * 128, bf16): 28 · 2 · 4 · 128 · 2.
 */
export const DEFAULT_KV_BYTES_PER_TOKEN = 57344;
/**
 * Bytes a link moves while a rank computes one token (forward and backward) on the same reference: 6 · 7.6e9 FLOPs
 * at 400 TFLOP/s is 114 µs, in which 50 GB/s moves 5.7 MB.
 */
export const DEFAULT_LINK_BYTES_PER_TOKEN = 5.7e6;

/** One way of planning built: its plan and what it costs per rank. */
export interface Built<P> {
  plan: P;
  computed: number;
  loads: Float64Array;
  bytes: Float64Array;
}

export function checkPlannerOptions(o: PlannerOptions): void {
  if (!Number.isSafeInteger(o.cpMax) || o.cpMax < 1 || o.cpMax > o.dp) throw argError('cp', `an integer from 1 to dp = ${o.dp}`, o.cpMax);
  for (const k of ['kvBytesPerToken', 'linkBytesPerToken'] as const) {
    const v = o[k];
    if (typeof v !== 'number' || !Number.isFinite(v) || v < 0 || (k === 'linkBytesPerToken' && v === 0))
      throw argError(k, k === 'linkBytesPerToken' ? 'a finite number > 0' : 'a finite number >= 0', v);
  }
}

/**
 * Builds every candidate with `build(mode, G)` and keeps the fastest; `build` throws a TreepackError (E_ARG) when
 * the way cannot hold the step. When none can, throws the refusal of the candidate with the most ranks per group
 * (the closest to fitting), naming its record, with every candidate's reason.
 */
export function choosePlan<P>(o: PlannerOptions, build: (mode: ParallelMode, G: number) => Built<P>): { plan: P; choice: StepChoice } {
  checkPlannerOptions(o);
  const ways: [ParallelMode, number][] = [['dp', 1]];
  if (o.share && o.dp > 1) ways.push(['shared', 1]);
  for (let G = 2; G <= o.cpMax; G++) if (o.dp % G === 0) ways.push(['cp', G]);
  const candidates: CandidateReport[] = [];
  let best: { built: Built<P>; report: CandidateReport; rank: number } | null = null;
  let lastError: TreepackError | null = null;
  ways.forEach(([mode, G], order) => {
    let built: Built<P>;
    try {
      built = build(mode, G);
    } catch (err) {
      if (!(err instanceof TreepackError) || err.code !== 'E_ARG') throw err;
      candidates.push({ mode, cp: G, refused: err.detail });
      lastError = err;
      return;
    }
    let time = 0,
      maxLoad = 0,
      maxBytes = 0;
    for (let r = 0; r < built.loads.length; r++) {
      time = Math.max(time, built.loads[r] + built.bytes[r] / o.linkBytesPerToken);
      maxLoad = Math.max(maxLoad, built.loads[r]);
      maxBytes = Math.max(maxBytes, built.bytes[r]);
    }
    const report: CandidateReport = {
      mode,
      cp: G,
      computed_tokens: built.computed,
      max_rank_cost: maxLoad,
      max_rank_bytes: maxBytes,
      time,
    };
    candidates.push(report);
    const better =
      best === null ||
      time < best.report.time! * (1 - 1e-9) ||
      (time <= best.report.time! * (1 + 1e-9) && built.computed < best.built.computed);
    if (better) best = { built, report, rank: order };
  });
  if (best === null) {
    const e = lastError!;
    const reasons = candidates.map((c) => `${c.mode}${c.cp > 1 ? ` over ${c.cp} ranks` : ''}: ${c.refused}`).join('; ');
    throw new TreepackError(
      'E_ARG',
      `no parallel plan can train this step within the budget (${reasons})${o.cpMax < o.dp ? `; --cp up to ${o.dp} may fit it` : ''}`,
      e.where,
    );
  }
  const { report } = best as { report: CandidateReport };
  const others = candidates.filter((c) => c !== report);
  const why =
    `${report.mode}${report.cp > 1 ? ` over ${report.cp} ranks` : ''}: time ${fmt(report.time!)} (compute ${fmt(report.max_rank_cost!)}, ` +
    `${fmt(report.max_rank_bytes!)} bytes), ${report.computed_tokens} tokens computed` +
    (others.length ? `; against ${others.map((c) => (c.refused ? `${c.mode} refused` : `${c.mode} ${fmt(c.time!)}`)).join(', ')}` : '');
  return { plan: (best as { built: Built<P> }).built.plan, choice: { mode: report.mode, cp: report.cp, why, candidates } };
}

const fmt = (x: number): string => (Number.isInteger(x) ? String(x) : x.toPrecision(6));
