/*
 * treepack loss C ABI (included by treepack.h): the per-token clipped-ratio RL loss over a packed micro-batch, its
 * gradient with respect to the node logprobs, and metrics. Semantics, names and codes are those of src/loss
 * (the TypeScript reference, which validates inputs before calling here); tp_loss_config, tp_loss_metrics and
 * their enum codes are in abi.h. The core re-checks what would make it read or write out of bounds. The CUDA twins
 * (native/cuda/treepack_cuda.h) take the same arguments, plus a stream, and return the same statuses.
 */
#ifndef TREEPACK_LOSS_H
#define TREEPACK_LOSS_H

#include <stdint.h>

#include "treepack.h" /* TP_API; treepack.h includes this file at its end */

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Per occurrence. seq_offsets [S+1] with seq_offsets[S] = num_occ = M; seq_positions, loss_mask, advantages,
 * old_logprobs [M]; ref_logprobs [M] when kl != NONE, rollout_logprobs [M] when tis != NONE (else may be NULL);
 * seq_weight [S] (NULL = every weight 1; README "Loss": each sequence's terms are multiplied by it, the counts are
 * not); turn_ids [M] when aggregation is TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN (else may be NULL); lp and grad [N].
 * grad may be NULL (loss and metrics only). Deterministic: occurrences are visited in order and accumulated in
 * double. Returns TP_ERR_ARG for a missing array or a config code out of range, TP_ERR_OFFSETS for bad offsets,
 * TP_ERR_INDEX for a position outside [0, N), TP_ERR_TURNS for turn ids that decrease along a sequence; nothing is
 * written then.
 */
TP_API int tp_loss(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* seq_offsets, int64_t num_occ,
                   const int32_t* seq_positions, const uint8_t* loss_mask, const float* advantages,
                   const float* old_logprobs, const float* ref_logprobs, const float* rollout_logprobs,
                   const float* seq_weight, const int32_t* turn_ids, int64_t num_nodes, const float* lp, float* grad,
                   tp_loss_metrics* out);

/*
 * The compact per-node form (src/loss/types.ts CompactPlan): every array [N]; ref may be NULL only when kl == NONE.
 * grad may be NULL. gspo is refused (TP_ERR_ARG). The plan's weights already hold the aggregation, seq_weight and
 * loss_scale: loss_scale is not applied again here.
 */
TP_API int tp_loss_compact(const tp_loss_config* cfg, int64_t num_nodes, const float* lp, const float* old,
                           const float* ref, const float* pos_weight, const float* neg_weight, const float* kl_weight,
                           const int32_t* n_train, const int32_t* n_pos, const int32_t* n_neg, float* grad,
                           tp_loss_metrics* out);

#ifdef __cplusplus
}
#endif

#endif /* TREEPACK_LOSS_H */
