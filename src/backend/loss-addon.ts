/**
 * The loss on the addons: the CPU addon (C++ core) and the CUDA addon take the same typed arrays (native/napi/
 * loss_binding.h), so one wrapper serves both. Inputs are checked by the dispatch layer (ops.ts).
 *
 * LossAddon is what the addons' loss entry points take and return; test/loss-addon.test.ts reads it from this file and
 * calls the real addon through it (arity, each parameter's name, type and nullability in its position, the metrics
 * returned), so a change here or in loss_binding.h without the other fails there.
 */
import type { LossConfig } from '../loss/config.js';
import type { CompactPlan, LossBatch, LossMetrics, LossResult } from '../loss/types.js';
import { configVector } from './abi.js';

export interface LossAddon {
  loss(
    config: Float64Array,
    seq_offsets: Int32Array,
    seq_positions: Int32Array,
    loss_mask: Uint8Array,
    advantages: Float32Array,
    old_logprobs: Float32Array,
    ref_logprobs: Float32Array | null,
    rollout_logprobs: Float32Array | null,
    seq_weight: Float32Array | null,
    turn_ids: Int32Array | null,
    lp: Float32Array,
    grad: Float32Array | null,
  ): LossMetrics;
  lossCompact(
    config: Float64Array,
    lp: Float32Array,
    old: Float32Array,
    ref: Float32Array | null,
    pos_weight: Float32Array,
    neg_weight: Float32Array,
    kl_weight: Float32Array,
    n_train: Int32Array,
    n_pos: Int32Array,
    n_neg: Int32Array,
    grad: Float32Array | null,
  ): LossMetrics;
}

export function addonLoss(addon: LossAddon, b: LossBatch, lp: Float32Array, cfg: LossConfig): LossResult {
  const grad = new Float32Array(lp.length);
  const metrics = addon.loss(
    configVector(cfg),
    b.seq_offsets,
    b.seq_positions,
    b.loss_mask,
    b.advantages!,
    b.old_logprobs!,
    cfg.kl !== 'none' ? b.ref_logprobs! : null,
    cfg.tis !== 'none' ? b.rollout_logprobs! : null,
    b.seq_weight ?? null,
    cfg.aggregation === 'seq-mean-turn-mean-token-mean' ? (b.turn_ids ?? null) : null,
    lp,
    grad,
  );
  return { loss: metrics.loss, grad, metrics };
}

export function addonLossCompact(addon: LossAddon, plan: CompactPlan, lp: Float32Array, cfg: LossConfig): LossResult {
  const grad = new Float32Array(lp.length);
  const metrics = addon.lossCompact(
    configVector(cfg),
    lp,
    plan.old,
    cfg.kl !== 'none' ? plan.ref : null,
    plan.pos_weight,
    plan.neg_weight,
    plan.kl_weight,
    plan.n_train,
    plan.n_pos,
    plan.n_neg,
    grad,
  );
  return { loss: metrics.loss, grad, metrics };
}
