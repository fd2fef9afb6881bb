/**
 * The dispatch layer: every op's input is checked here, once, against the chosen backend's limits, and then handed
 * to that backend's kernel, which assumes it well formed. `resolveKernel` gives the checked kernel of an op;
 * `computeLoss`, `computeLossCompact` and `lowerMasks` are the pipeline's calls through it.
 */
import { resolveLossConfig, type LossConfig } from '../loss/config.js';
import type { CompactPlan, LossBatch, LossResult } from '../loss/types.js';
import { validateCompactInputs, validateLossInputs } from '../loss/validate.js';
import type { BlockMask, MaskSpec, TreeArrays } from '../mask/types.js';
import { checkMaskCall, type OutputLimits } from '../mask/validate.js';
import { validateSequences } from '../pack/validate.js';
import { findKernel, type BackendName, type Kernels, type OpName } from './registry.js';

type Check<K extends OpName> = (limits: OutputLimits, ...args: Parameters<Kernels[K]>) => void;

const CHECKS: { [K in OpName]: Check<K> } = {
  packForest: (_, seqs) => validateSequences(seqs),
  maskDense: (limits, tree) => void checkMaskCall('maskDense', tree, undefined, limits),
  maskBits: (limits, tree) => void checkMaskCall('maskBits', tree, undefined, limits),
  maskBlocks: (limits, tree, blockSize) => void checkMaskCall('maskBlocks', tree, blockSize, limits),
  maskSlices: (limits, tree) => void checkMaskCall('maskSlices', tree, undefined, limits),
  maskCuSeqlens: (limits, tree) => void checkMaskCall('maskCuSeqlens', tree, undefined, limits),
  loss: (_, batch, lp, cfg) => validateLossInputs(batch, lp, cfg),
  lossCompact: (_, plan, lp) => validateCompactInputs(plan, lp),
};

/** Ops whose kernels return a promise: a failed check is then a rejection, as a kernel's own failure would be. */
const SYNC_OPS: ReadonlySet<OpName> = new Set(['packForest']);

/** An op resolved to a backend's kernel, with the report of why that backend. */
export interface Resolved<K extends OpName> {
  backend: BackendName;
  /** The backend's kernel behind the op's checks. */
  kernel: Kernels[K];
  /** The chosen backend and, before it, every higher-priority backend skipped and why. */
  report: string;
}

/**
 * The kernel for `op`: on `preferred` when given (an error if it is unavailable or lacks the op: an explicit choice
 * is never silently replaced), else on the highest-priority available backend that implements it. Its input is
 * checked before the backend sees it.
 */
export async function resolveKernel<K extends OpName>(op: K, preferred?: BackendName | 'auto'): Promise<Resolved<K>> {
  const found = await findKernel(op, preferred);
  // The table and the kernel are typed per op; their union over K is beyond TypeScript, hence the plain signatures.
  const check = CHECKS[op] as (limits: OutputLimits, ...args: unknown[]) => void;
  const impl = found.kernel as (...args: unknown[]) => unknown;
  const kernel = SYNC_OPS.has(op)
    ? (...args: unknown[]) => {
        check(found.limits, ...args);
        return impl(...args);
      }
    : async (...args: unknown[]) => {
        check(found.limits, ...args);
        return impl(...args);
      };
  return { backend: found.backend, kernel: kernel as unknown as Kernels[K], report: found.report };
}

/** Which backend computeLoss runs on (default `auto`). */
export interface LossOptions {
  backend?: BackendName | 'auto';
}

/** A loss result with the backend that computed it and why. */
export interface LossRun extends LossResult {
  /** Which backend ran and why (the registry's report). */
  backend: BackendName;
  report: string;
}

/** Loss, dloss/dlp [N] and metrics of node logprobs `lp` [N] on `batch`; `config` is filled with defaults and checked. */
export async function computeLoss(
  batch: LossBatch,
  lp: Float32Array,
  config: Partial<LossConfig> | LossConfig = {},
  opts: LossOptions = {},
): Promise<LossRun> {
  const cfg = resolveLossConfig(config);
  const k = await resolveKernel('loss', opts.backend);
  return { ...(await k.kernel(batch, lp, cfg)), backend: k.backend, report: k.report };
}

/** computeLoss from a compact plan built with the same config (buildCompactPlan): O(N) per call instead of O(M). */
export async function computeLossCompact(
  plan: CompactPlan,
  lp: Float32Array,
  config: Partial<LossConfig> | LossConfig = {},
  opts: LossOptions = {},
): Promise<LossRun> {
  const cfg = resolveLossConfig(config);
  const k = await resolveKernel('lossCompact', opts.backend);
  return { ...(await k.kernel(plan, lp, cfg)), backend: k.backend, report: k.report };
}

export interface LoweredMasks {
  blocks?: BlockMask;
  slices?: Int32Array;
  cuSeqlens?: Int32Array;
  /** Per lowering, in the order of the specs, which backend built it and why. */
  reports: string[];
}

/** The lowerings of `specs` on the best available backend (or `backend`). */
export async function lowerMasks(tree: TreeArrays, specs: readonly MaskSpec[], backend?: BackendName | 'auto'): Promise<LoweredMasks> {
  const out: LoweredMasks = { reports: [] };
  for (const spec of specs) {
    if (spec.kind === 'blocks') {
      const r = await resolveKernel('maskBlocks', backend);
      out.blocks = await r.kernel(tree, spec.blockSize);
      out.reports.push(r.report);
    } else if (spec.kind === 'slices') {
      const r = await resolveKernel('maskSlices', backend);
      out.slices = await r.kernel(tree);
      out.reports.push(r.report);
    } else {
      const r = await resolveKernel('maskCuSeqlens', backend);
      out.cuSeqlens = await r.kernel(tree);
      out.reports.push(r.report);
    }
  }
  return out;
}
