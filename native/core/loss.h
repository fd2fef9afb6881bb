/*
 * treepack loss C ABI (included by treepack.h): the per-token clipped-ratio RL loss over a packed micro-batch, its
 * gradient with respect to the node logprobs, and metrics. Semantics, names and codes are those of src/loss
 * (the TypeScript reference, which validates inputs before calling here); the core re-checks only what would
 * make it read or write out of bounds.
 */
#ifndef TREEPACK_LOSS_H
#define TREEPACK_LOSS_H

#include <stdint.h>

#include "treepack.h" /* TP_API; treepack.h includes this file at its end */

#ifdef __cplusplus
extern "C" {
#endif

enum tp_loss_policy { TP_POLICY_PPO = 0, TP_POLICY_GSPO = 1, TP_POLICY_CISPO = 2 };
enum tp_loss_aggregation {
  TP_AGG_TOKEN_MEAN = 0,
  TP_AGG_SEQ_MEAN_TOKEN_SUM = 1,
  TP_AGG_SEQ_MEAN_TOKEN_MEAN = 2,
  TP_AGG_SEQ_MEAN_TOKEN_SUM_NORM = 3
};
enum tp_loss_kl { TP_KL_NONE = 0, TP_KL_K1 = 1, TP_KL_ABS = 2, TP_KL_K2 = 3, TP_KL_K3 = 4 };
enum tp_loss_tis { TP_TIS_NONE = 0, TP_TIS_TOKEN = 1, TP_TIS_SEQUENCE = 2 };

typedef struct tp_loss_config {
  int32_t policy, aggregation, kl, tis;
  double clip_low, clip_high;
  double dual_clip; /* 0 = off */
  double log_ratio_clamp;
  double norm_constant;
  double global_tokens, global_sequences; /* 0 = this micro-batch's own counts */
  double kl_coef;
  double tis_cap;
} tp_loss_config;

typedef struct tp_loss_metrics {
  double loss, pg_loss, kl_loss;
  double clipfrac_high, clipfrac_low, clipfrac_dual;
  double approx_kl;
  double ratio_min, ratio_mean, ratio_max;
  int64_t trainable_tokens;
} tp_loss_metrics;

/*
 * Per occurrence. seq_offsets [S+1]; seq_positions, loss_mask, advantages, old_logprobs [M]; ref_logprobs [M] when
 * kl != NONE, rollout_logprobs [M] when tis != NONE (else may be NULL); lp and grad [N]. grad may be NULL (loss
 * and metrics only). Deterministic: occurrences are visited in order and accumulated in double.
 * Returns TP_ERR_ARG for a missing array or a position outside [0, N), TP_ERR_OFFSETS for bad offsets.
 */
TP_API int tp_loss(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* seq_offsets,
                   const int32_t* seq_positions, const uint8_t* loss_mask, const float* advantages,
                   const float* old_logprobs, const float* ref_logprobs, const float* rollout_logprobs,
                   int64_t num_nodes, const float* lp, float* grad, tp_loss_metrics* out);

/*
 * The compact per-node form (src/loss/types.ts CompactPlan): every array [N]; ref may be NULL when kl == NONE.
 * grad may be NULL. gspo is refused (TP_ERR_ARG).
 */
TP_API int tp_loss_compact(const tp_loss_config* cfg, int64_t num_nodes, const float* lp, const float* old,
                           const float* ref, const float* pos_weight, const float* neg_weight,
                           const float* kl_weight, const int32_t* n_train, const int32_t* n_pos,
                           const int32_t* n_neg, float* grad, tp_loss_metrics* out);

#ifdef __cplusplus
}
#endif

#endif /* TREEPACK_LOSS_H */
