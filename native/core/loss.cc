// The RL loss on the CPU: per occurrence (tp_loss) and per node (tp_loss_compact). See loss.h.
#include <vector>

#include "loss_math.h"
#include "treepack.h"

namespace tl = treepack::loss;

extern "C" {

int tp_loss(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* off, int64_t M, const int32_t* pos,
            const uint8_t* mask, const float* adv, const float* old, const float* ref, const float* roll,
            const float* seq_weight, const int32_t* turn, int64_t num_nodes, const float* lp, float* grad,
            tp_loss_metrics* out) {
  int rc = tl::CheckLossArgs(cfg, num_seqs, off, M, pos, mask, adv, old, ref, roll, turn, num_nodes, lp, out);
  if (rc != TP_OK) return rc;
  const tp_loss_config& c = *cfg;
  // Offsets first, then positions: with both wrong, TP_ERR_OFFSETS, as tp_cuda_loss reports it.
  if (off[0] != 0 || off[num_seqs] != M) return TP_ERR_OFFSETS;
  for (int64_t i = 0; i < num_seqs; i++) {
    if (off[i + 1] < off[i]) return TP_ERR_OFFSETS;
  }
  for (int64_t j = 0; j < M; j++) {
    if (pos[j] < 0 || pos[j] >= num_nodes) return TP_ERR_INDEX;
  }
  const bool turns = c.aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN;
  if (turns) {
    for (int64_t i = 0; i < num_seqs; i++) {
      for (int64_t j = off[i] + 1; j < off[i + 1]; j++) {
        if (turn[j] < turn[j - 1]) return TP_ERR_TURNS;
      }
    }
  }
  std::vector<int32_t> counts(static_cast<size_t>(num_seqs));
  double tokens = 0, sequences = 0;
  for (int64_t i = 0; i < num_seqs; i++) {
    int32_t n = 0;
    for (int64_t j = off[i]; j < off[i + 1]; j++) n += mask[j] != 0;
    counts[i] = n;
    tokens += n;
    sequences += n > 0;
  }
  if (c.global_tokens > 0) tokens = c.global_tokens;
  if (c.global_sequences > 0) sequences = c.global_sequences;

  std::vector<double> acc(grad != nullptr ? static_cast<size_t>(num_nodes) : 0);
  tl::Sums sums;
  for (int64_t i = 0; i < num_seqs; i++) {
    const int32_t n = counts[i];
    if (n == 0) continue;
    const double scale = tl::SequenceScale(c, seq_weight, i);
    const int64_t a = off[i], e = off[i + 1];
    double w = turns ? 0 : tl::SequenceWeight(c, n, tokens, sequences) * scale;
    // The turn mode: k turns with trainable tokens; each run of equal ids gets its weight where it starts.
    double k = 0;
    int64_t run_end = a;
    if (turns) {
      for (int64_t r = a; r < e;) {
        int32_t m = 0;
        int64_t q = r;
        for (; q < e && turn[q] == turn[r]; q++) m += mask[q] != 0;
        k += m > 0;
        r = q;
      }
    }
    double seq_log_ratio = 0, seq_tis = 1;
    if (c.policy == TP_POLICY_GSPO) {
      for (int64_t j = a; j < e; j++)
        if (mask[j]) seq_log_ratio += static_cast<double>(lp[pos[j]]) - old[j];
      seq_log_ratio /= n;
    }
    if (c.tis == TP_TIS_SEQUENCE) {
      double s = 0;
      for (int64_t j = a; j < e; j++)
        if (mask[j]) s += static_cast<double>(old[j]) - roll[j];
      seq_tis = tl::TruncatedWeight(s, c);
    }
    for (int64_t j = a; j < e; j++) {
      if (turns && j == run_end) {
        int32_t m = 0;
        for (run_end = j; run_end < e && turn[run_end] == turn[j]; run_end++) m += mask[run_end] != 0;
        w = m > 0 ? tl::TurnWeight(sequences, k, m) * scale : 0;
      }
      if (!mask[j]) continue;
      const int32_t p = pos[j];
      const double tis =
          c.tis == TP_TIS_TOKEN ? tl::TruncatedWeight(static_cast<double>(old[j]) - roll[j], c) : seq_tis;
      const double g =
          tl::Occurrence(c, w, tis, seq_log_ratio, lp[p], old[j], adv[j], ref != nullptr ? ref[j] : 0, &sums);
      if (grad != nullptr) acc[p] += g;
    }
  }
  if (grad != nullptr) {
    for (int64_t p = 0; p < num_nodes; p++) grad[p] = static_cast<float>(acc[p]);
  }
  sums.Finish(c.kl_coef, out);
  return TP_OK;
}

int tp_loss_compact(const tp_loss_config* cfg, int64_t N, const float* lp, const float* old, const float* ref,
                    const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                    const int32_t* n_pos, const int32_t* n_neg, float* grad, tp_loss_metrics* out) {
  const int rc = tl::CheckCompactArgs(cfg, N, lp, old, ref, pos_w, neg_w, kl_w, n_train, n_pos, n_neg, out);
  if (rc != TP_OK) return rc;
  const tp_loss_config& c = *cfg;
  tl::Sums sums;
  for (int64_t p = 0; p < N; p++) {
    const double g = n_train[p] == 0 ? 0
                                     : tl::Node(c, lp[p], old[p], pos_w[p], neg_w[p], kl_w[p],
                                                ref != nullptr ? ref[p] : 0, n_train[p], n_pos[p], n_neg[p], &sums);
    if (grad != nullptr) grad[p] = static_cast<float>(g);
  }
  sums.Finish(c.kl_coef, out);
  return TP_OK;
}

}  // extern "C"
