/**
 * One window of samples → budgeted micro-batches: plans the split (budget.ts), then assembles each micro-batch
 * from its samples with the caller's packer and pads it.
 */
import { TreepackError } from '../errors.js';
import type { Sample } from '../records/types.js';
import { assembleMicroBatch, toSequences, type AssembleOptions } from './batch.js';
import { keyByRoutes } from './routes.js';
import { planMicroBatches, type BudgetOptions, type MicroBatchPlan, type Plan } from './budget.js';
import type { Forest, MicroBatch } from './contract.js';

/** The options of packWindow: how to assemble micro-batches and how to cut them. */
export interface WindowOptions extends AssembleOptions, BudgetOptions {
  /** token id of pad nodes; default 0 */
  padTokenId?: number;
  /** added to the plan's shared piece ids in the headers' prefix_shared: the pieces of earlier windows; default 0 */
  sharedPieceBase?: number;
}

/** A micro-batch of a window under a budget: the batch, its samples and its plan. */
export interface BudgetedMicroBatch {
  batch: MicroBatch;
  samples: Sample[];
  plan: MicroBatchPlan;
}

/** Cuts a window of samples into micro-batches under a token budget and packs each. */
export function packWindow(samples: readonly Sample[], opts: WindowOptions): { microBatches: BudgetedMicroBatch[]; plan: Plan } {
  // The plan sees the forest as the packer builds it: split where routes differ (src/pack/routes.ts).
  const plan = planMicroBatches(
    keyByRoutes(samples, toSequences(samples), opts.routeConflict ?? 'split', opts.packForest).seqs,
    opts,
    samples.map((s) => s.id),
  );
  const microBatches = plan.microBatches.map((mb) => {
    const members = Array.from(mb.sequences, (i) => samples[i]);
    const batch = assembleMicroBatch(members, opts);
    const unpadded = mb.packedTokens - mb.padTokens;
    // The plan counts tokens from sorted prefixes, the packer builds the forest: a mismatch is a bug in one of them.
    if (batch.meta.num_tokens_packed !== unpadded) {
      throw new TreepackError(
        'E_BACKEND',
        `planned ${unpadded} packed tokens for a micro-batch but its forest has ${batch.meta.num_tokens_packed}`,
      );
    }
    const padded = mb.padTokens > 0 ? padForest(batch, mb.padTokens, opts.padTokenId ?? 0) : batch;
    if ((opts.padMultiple ?? 1) > 1) padded.meta = { ...padded.meta, num_tokens_packed: mb.packedTokens, num_pad_tokens: mb.padTokens };
    if (mb.prefix)
      padded.meta = { ...padded.meta, prefix_tokens: mb.prefix.tokens, prefix_push: mb.prefix.push, prefix_release: mb.prefix.release };
    const base = opts.sharedPieceBase ?? 0;
    if (mb.prefix?.shared) padded.meta = { ...padded.meta, prefix_shared: mb.prefix.shared.map((id) => (id === null ? null : id + base)) };
    if (mb.cpRanks) padded.meta = { ...padded.meta, cp_ranks: mb.cpRanks };
    return { batch: padded, samples: members, plan: mb };
  });
  return { microBatches, plan };
}

/**
 * Appends `count` pad nodes: each a root that attends only to itself, at position 0, with no occurrence, so no
 * sequence and no loss term reads it. The occurrence arrays are untouched.
 */
export function padForest<F extends Forest>(f: F, count: number, padTokenId: number): F {
  const N = f.input_ids.length,
    n = N + count;
  const grow = (a: Int32Array, fill: (p: number) => number) => {
    const out = new Int32Array(n);
    out.set(a);
    for (let p = N; p < n; p++) out[p] = fill(p);
    return out;
  };
  const { routes, meta, mrope_position_ids: mrope } = f as Partial<MicroBatch>;
  const padded = {
    ...f,
    input_ids: grow(f.input_ids, () => padTokenId),
    position_ids: grow(f.position_ids, () => 0),
    parent: grow(f.parent, () => -1),
    subtree_end: grow(f.subtree_end, (p) => p + 1),
    ...(mrope !== undefined && { mrope_position_ids: growRows(mrope, N, n) }),
  };
  if (routes) {
    // Pad nodes are routed by nobody: −1 rows.
    const grown = new Int16Array(meta!.routes_layers! * meta!.routes_top_k! * n).fill(-1);
    grown.set(routes);
    (padded as Partial<MicroBatch>).routes = grown;
  }
  return padded;
}

/** A [rows, N] array widened to [rows, n], the new columns 0 (a pad node's position). */
function growRows(a: Int32Array, N: number, n: number): Int32Array {
  const rows = a.length / N;
  const out = new Int32Array(rows * n);
  for (let r = 0; r < rows; r++) out.set(a.subarray(r * N, (r + 1) * N), r * n);
  return out;
}
