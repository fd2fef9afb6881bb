/**
 * The RL loss over packed micro-batches: validation, then the kernel of the chosen backend (cuda → webgpu → cpu →
 * js by availability, or the one named). See README "Loss" for formulas and config.
 */
import { resolveKernel, type BackendName } from '../backend/index.js';
import type { LossConfig } from './config.js';
import { resolveLossConfig } from './config.js';
import { compactPlan } from './reference.js';
import type { CompactPlan, LossBatch, LossResult } from './types.js';
import { lossInputError, validateCompactInputs, validateLossInputs } from './validate.js';

export interface LossOptions {
  backend?: BackendName | 'auto';
}

export interface LossRun extends LossResult {
  /** Which backend ran and why (the registry's report). */
  backend: BackendName;
  report: string;
}

/** Loss, dloss/dlp [N] and metrics of node logprobs `lp` [N] on `batch`; `config` is filled with defaults and checked. */
export async function computeLoss(batch: LossBatch, lp: Float32Array, config: Partial<LossConfig> | LossConfig = {}, opts: LossOptions = {}): Promise<LossRun> {
  const cfg = resolveLossConfig(config);
  validateLossInputs(batch, lp, cfg);
  const k = await resolveKernel('loss', opts.backend);
  return { ...(await k.kernel(batch, lp, cfg)), backend: k.backend, report: k.report };
}

/** The compact per-node plan (DESIGN §4) of a batch; throws E_INPUT when occurrences of a node disagree on old (or ref). */
export function buildCompactPlan(batch: LossBatch, config: Partial<LossConfig> | LossConfig = {}): CompactPlan {
  const cfg = resolveLossConfig(config);
  validateLossInputs(batch, new Float32Array(batch.input_ids.length), cfg);
  return compactPlan(batch, cfg, lossInputError);
}

/** computeLoss from a compact plan built with the same config: O(N) per call instead of O(M). */
export async function computeLossCompact(plan: CompactPlan, lp: Float32Array, config: Partial<LossConfig> | LossConfig = {}, opts: LossOptions = {}): Promise<LossRun> {
  const cfg = resolveLossConfig(config);
  validateCompactInputs(plan, lp);
  const k = await resolveKernel('lossCompact', opts.backend);
  return { ...(await k.kernel(plan, lp, cfg)), backend: k.backend, report: k.report };
}

export { resolveLossConfig, DEFAULT_LOSS_CONFIG, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, TIS_LEVELS } from './config.js';
export type { LossConfig, PolicyLoss, Aggregation, KlEstimator, TisLevel } from './config.js';
export { episodeAdvantages, sampleAdvantages, fillAdvantages, ADVANTAGE_ESTIMATORS, type AdvantageEstimator, type AdvantageOptions } from './advantages.js';
export type { CompactPlan, LossBatch, LossMetrics, LossResult } from './types.js';
