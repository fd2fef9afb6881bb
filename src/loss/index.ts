/**
 * The RL loss over packed micro-batches, as formulas: config, advantages, the js reference and the compact plan.
 * Running it on a backend is computeLoss / computeLossCompact (src/backend/ops.ts). See docs/concepts/loss.md.
 */
import type { LossConfig } from './config.js';
import { resolveLossConfig } from './config.js';
import { compactPlan } from './reference.js';
import type { CompactPlan, LossBatch } from './types.js';
import { lossInputError, validateLossInputs } from './validate.js';

/** The compact per-node plan (docs/design.md §4) of a batch; throws E_INPUT when occurrences of a node disagree on old (or ref). */
export function buildCompactPlan(batch: LossBatch, config: Partial<LossConfig> | LossConfig = {}): CompactPlan {
  const cfg = resolveLossConfig(config);
  validateLossInputs(batch, new Float32Array(batch.input_ids.length), cfg);
  return compactPlan(batch, cfg, lossInputError);
}

export { resolveLossConfig, DEFAULT_LOSS_CONFIG, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, TIS_LEVELS } from './config.js';
export type { LossConfig, PolicyLoss, Aggregation, KlEstimator, TisLevel } from './config.js';
export {
  episodeAdvantages,
  sampleAdvantages,
  fillAdvantages,
  ADVANTAGE_ESTIMATORS,
  type AdvantageEstimator,
  type AdvantageOptions,
} from './advantages.js';
export type { CompactPlan, LossBatch, LossMetrics, LossResult } from './types.js';
export { validateLossInputs };
