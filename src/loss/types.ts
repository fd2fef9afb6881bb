/** What every loss backend takes and returns. */
import type { MicroBatch } from '../pack/contract.js';

/**
 * The micro-batch fields the loss reads (`input_ids` only gives N; `turn_ids` only for the turn aggregation), and
 * `seq_weight` [S], a trainer's per-sequence weight (docs/concepts/loss.md, "Aggregation and weights"), never stored in the contract.
 */
export type LossBatch = Pick<
  MicroBatch,
  | 'input_ids'
  | 'seq_offsets'
  | 'seq_positions'
  | 'loss_mask'
  | 'advantages'
  | 'old_logprobs'
  | 'ref_logprobs'
  | 'rollout_logprobs'
  | 'turn_ids'
> & {
  seq_weight?: Float32Array;
};

/** The metrics of a loss computation, as the C ABI's tp_loss_metrics names them. */
export interface LossMetrics {
  loss: number; // pg_loss + kl_coef · kl_loss
  pg_loss: number;
  kl_loss: number;
  /** Fractions of trainable tokens: upper clip active (A > 0, r > 1+εh; cispo: r > 1+εh), lower (A < 0, r < 1−εl), dual clip. */
  clipfrac_high: number;
  clipfrac_low: number;
  clipfrac_dual: number;
  /** mean(old − lp) over trainable tokens (verl's ppo_kl). */
  approx_kl: number;
  ratio_min: number;
  ratio_mean: number;
  ratio_max: number;
  trainable_tokens: number;
}

/** A loss computation: the scalar loss, dloss/dlp per node, and the metrics. */
export interface LossResult {
  loss: number;
  /** dloss/dlp [N]: the sum over every occurrence mapped to each node. */
  grad: Float32Array;
  metrics: LossMetrics;
}

/**
 * The compact per-node form (docs/design.md §4): valid when all trainable occurrences of a node share old (and ref)
 * logprobs. The surrogate is then linear in the advantage for a fixed ratio, so per node it is enough to know the
 * weighted sums of positive and negative advantages (aggregation weight and truncated IS weight folded in), the
 * KL weight, and the counts the metrics need. Built once per micro-batch and config; evaluated per lp over N nodes.
 */
export interface CompactPlan {
  num_nodes: number;
  old: Float32Array; // [N]
  ref: Float32Array; // [N], zeros without KL
  pos_weight: Float32Array; // Σ w·A over trainable occurrences with A > 0
  neg_weight: Float32Array; // Σ w·|A| over those with A < 0
  kl_weight: Float32Array; // Σ w (aggregation weight) over trainable occurrences
  n_train: Int32Array; // trainable occurrences
  n_pos: Int32Array; // … with A > 0
  n_neg: Int32Array; // … with A < 0
  trainable_tokens: number;
}
