// The per-token loss formulas shared by the C++ core (loss.cc) and the CUDA kernels (native/cuda/loss.cu), so both
// compute exactly what src/loss/policy.ts and kl.ts define. Host-and-device inline functions, double precision.
#ifndef TREEPACK_LOSS_MATH_H
#define TREEPACK_LOSS_MATH_H

#include <math.h>
#include <stdint.h>

#include "abi.h"
#include "inline.h"

namespace treepack {
namespace loss {

constexpr int kClippedHigh = 1, kClippedLow = 2, kClippedDual = 4;
constexpr double kK3LogClamp = TP_K3_LOG_CLAMP, kK3ValueClamp = TP_K3_VALUE_CLAMP;

// Every code of the config names a formula.
inline bool ConfigOk(const tp_loss_config* c) {
  return c != nullptr && c->policy >= 0 && c->policy < TP_POLICY_COUNT && c->aggregation >= 0 &&
         c->aggregation < TP_AGG_COUNT && c->kl >= 0 && c->kl < TP_KL_COUNT && c->tis >= 0 && c->tis < TP_TIS_COUNT;
}

// The argument checks of tp_loss and tp_cuda_loss (and their _host forms), before any value is read: the arrays
// the config needs are present and the counts fit. The values (offsets, positions) are checked where they live.
inline int CheckLossArgs(const tp_loss_config* c, int64_t S, const int32_t* off, int64_t M, const int32_t* pos,
                         const uint8_t* mask, const float* adv, const float* old, const float* ref, const float* roll,
                         const int32_t* turns, int64_t N, const float* lp, const tp_loss_metrics* out) {
  if (!ConfigOk(c) || out == nullptr || S < 0 || M < 0 || N < 0 || off == nullptr) return TP_ERR_ARG;
  if (M > 0 && (pos == nullptr || mask == nullptr || adv == nullptr || old == nullptr ||
                (c->kl != TP_KL_NONE && ref == nullptr) || (c->tis != TP_TIS_NONE && roll == nullptr) ||
                (c->aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN && turns == nullptr))) {
    return TP_ERR_ARG;
  }
  if (N > 0 && lp == nullptr) return TP_ERR_ARG;
  if (S > INT32_MAX || M > INT32_MAX || N > INT32_MAX) return TP_ERR_TOO_LARGE;
  return TP_OK;
}

// The same for the compact form: every array present when N > 0 (ref only with KL), no GSPO.
inline int CheckCompactArgs(const tp_loss_config* c, int64_t N, const float* lp, const float* old, const float* ref,
                            const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                            const int32_t* n_pos, const int32_t* n_neg, const tp_loss_metrics* out) {
  if (!ConfigOk(c) || out == nullptr || N < 0 || c->policy == TP_POLICY_GSPO) return TP_ERR_ARG;
  if (N > 0 &&
      (lp == nullptr || old == nullptr || pos_w == nullptr || neg_w == nullptr || kl_w == nullptr ||
       n_train == nullptr || n_pos == nullptr || n_neg == nullptr || (c->kl != TP_KL_NONE && ref == nullptr))) {
    return TP_ERR_ARG;
  }
  if (N > INT32_MAX) return TP_ERR_TOO_LARGE;
  return TP_OK;
}

TP_HD double Clamp(double x, double lo, double hi) { return x < lo ? lo : x > hi ? hi : x; }

struct Term {
  double value, deriv, ratio;
};

// max(−A·r, −A·clip(r)), then min(·, −A·c) for A < 0 with dual clip; r = exp(clamp(log_ratio)).
TP_HD int ClippedSurrogate(double log_ratio, double A, const tp_loss_config& c, Term* t) {
  const double C = c.log_ratio_clamp;
  const double r = exp(Clamp(log_ratio, -C, C));
  const double dr = log_ratio >= -C && log_ratio <= C ? r : 0;
  const double l1 = -A * r, l2 = -A * Clamp(r, 1 - c.clip_low, 1 + c.clip_high);
  int flags = 0;
  double loss = l1, d = -A * dr;
  if (l2 > l1) {
    loss = l2;
    d = 0;
    flags = A > 0 ? kClippedHigh : kClippedLow;
  }
  if (A < 0 && c.dual_clip > 0 && loss > -A * c.dual_clip) {
    loss = -A * c.dual_clip;
    d = 0;
    flags |= kClippedDual;
  }
  t->value = loss;
  t->deriv = d;
  t->ratio = r;
  return flags;
}

TP_HD int Cispo(double lp, double old, double A, const tp_loss_config& c, Term* t) {
  const double r = exp(Clamp(lp - old, -c.log_ratio_clamp, c.log_ratio_clamp));
  const double w = Clamp(r, 1 - c.clip_low, 1 + c.clip_high);
  t->value = -w * A * lp;
  t->deriv = -w * A;
  t->ratio = r;
  return r > 1 + c.clip_high ? kClippedHigh : r < 1 - c.clip_low ? kClippedLow : 0;
}

TP_HD double TruncatedWeight(double log_w, const tp_loss_config& c) {
  const double w = exp(Clamp(log_w, -c.log_ratio_clamp, c.log_ratio_clamp));
  return w < c.tis_cap ? w : c.tis_cap;
}

TP_HD void Kl(int kind, double lp, double ref, Term* t) {
  const double diff = lp - ref;
  switch (kind) {
    case TP_KL_K1:
      t->value = diff;
      t->deriv = 1;
      return;
    case TP_KL_ABS:
      t->value = fabs(diff);
      t->deriv = diff > 0 ? 1 : diff < 0 ? -1 : 0;
      return;
    case TP_KL_K2:
      t->value = 0.5 * diff * diff;
      t->deriv = diff;
      return;
    case TP_KL_K3: {
      const double x = -diff, xc = Clamp(x, -kK3LogClamp, kK3LogClamp);
      const double e = exp(xc), v = e - xc - 1;
      const bool inside = x >= -kK3LogClamp && x <= kK3LogClamp && v <= kK3ValueClamp && v >= -kK3ValueClamp;
      t->value = Clamp(v, -kK3ValueClamp, kK3ValueClamp);
      t->deriv = inside ? 1 - e : 0;
      return;
    }
    default:
      t->value = 0;
      t->deriv = 0;
  }
}

// The aggregation weight of each trainable token of a sequence with n > 0 of them (src/loss/aggregate.ts), before
// seq_weight and loss_scale; not for the turn mode (TurnWeight).
TP_HD double SequenceWeight(const tp_loss_config& c, double n, double tokens, double sequences) {
  switch (c.aggregation) {
    case TP_AGG_TOKEN_MEAN:
      return 1 / tokens;
    case TP_AGG_SEQ_MEAN_TOKEN_SUM:
      return 1 / sequences;
    case TP_AGG_SEQ_MEAN_TOKEN_MEAN:
      return 1 / (sequences * n);
    default:
      return 1 / c.norm_constant;
  }
}

// The turn mode's weight of a token of a turn with n trainable tokens, in a sequence with k turns that have any.
TP_HD double TurnWeight(double sequences, double k, double n) { return 1 / (sequences * k * n); }

// What every weight of sequence i is multiplied by: its seq_weight (1 without) times loss_scale.
TP_HD double SequenceScale(const tp_loss_config& c, const float* seq_weight, int64_t i) {
  return (seq_weight != nullptr ? static_cast<double>(seq_weight[i]) : 1.0) * c.loss_scale;
}

// Compact per-node surrogate (see src/loss/reference.ts lossCompactReference): value, derivative, clip flags of
// the positive and negative occurrences.
struct NodeTerm {
  double value, deriv, ratio;
  int pos_flags, neg_flags;
};

TP_HD void CompactNode(double lp, double old, double P, double Q, const tp_loss_config& c, NodeTerm* t) {
  const double C = c.log_ratio_clamp, lr = lp - old;
  const double r = exp(Clamp(lr, -C, C));
  const double dr = lr >= -C && lr <= C ? r : 0;
  const double hi = 1 + c.clip_high, lo = 1 - c.clip_low;
  t->ratio = r;
  if (c.policy == TP_POLICY_CISPO) {
    const double w = Clamp(r, lo, hi);
    t->value = -w * lp * (P - Q);
    t->deriv = -w * (P - Q);
    t->pos_flags = t->neg_flags = r > hi ? kClippedHigh : r < lo ? kClippedLow : 0;
    return;
  }
  const bool high = r > hi, low = r < lo;
  const double up = low ? lo : r;
  const bool dual = c.dual_clip > 0 && up > c.dual_clip;
  t->value = -P * (high ? hi : r) + Q * (dual ? c.dual_clip : up);
  t->deriv = -P * (high ? 0 : dr) + Q * (dual || low ? 0 : dr);
  t->pos_flags = high ? kClippedHigh : 0;
  t->neg_flags = (low ? kClippedLow : 0) | (dual ? kClippedDual : 0);
}

// Metric sums: identical order of operations on every backend that uses them.
struct Sums {
  double pg = 0, kl = 0, n = 0, high = 0, low = 0, dual = 0, log_ratio = 0, ratio = 0;
  double min = INFINITY, max = -INFINITY;

  TP_HD void Add(double count, int flags, double r, double old_minus_lp) {
    if (count == 0) return;
    n += count;
    if (flags & kClippedHigh) high += count;
    if (flags & kClippedLow) low += count;
    if (flags & kClippedDual) dual += count;
    ratio += count * r;
    log_ratio += count * old_minus_lp;
    if (r < min) min = r;
    if (r > max) max = r;
  }

  TP_HD void Merge(const Sums& o) {
    pg += o.pg;
    kl += o.kl;
    n += o.n;
    high += o.high;
    low += o.low;
    dual += o.dual;
    log_ratio += o.log_ratio;
    ratio += o.ratio;
    if (o.min < min) min = o.min;
    if (o.max > max) max = o.max;
  }

  TP_HD void Finish(double kl_coef, tp_loss_metrics* m) const {
    m->pg_loss = pg;
    m->kl_loss = kl;
    m->loss = pg + kl_coef * kl;
    m->clipfrac_high = n ? high / n : 0;
    m->clipfrac_low = n ? low / n : 0;
    m->clipfrac_dual = n ? dual / n : 0;
    m->approx_kl = n ? log_ratio / n : 0;
    m->ratio_mean = n ? ratio / n : 0;
    m->ratio_min = n ? min : 0;
    m->ratio_max = n ? max : 0;
    m->trainable_tokens = static_cast<int64_t>(n);
  }
};

// One trainable occurrence with aggregation weight w and IS weight tis: adds to the sums, returns dloss/dlp.
TP_HD double Occurrence(const tp_loss_config& c, double w, double tis, double seq_log_ratio, double x, double old,
                        double A, double ref, Sums* s) {
  Term t;
  const int flags = c.policy == TP_POLICY_CISPO
                        ? Cispo(x, old, A, c, &t)
                        : ClippedSurrogate(c.policy == TP_POLICY_GSPO ? seq_log_ratio : x - old, A, c, &t);
  s->pg += w * tis * t.value;
  double g = w * tis * t.deriv;
  s->Add(1, flags, t.ratio, old - x);
  if (c.kl != TP_KL_NONE) {
    Kl(c.kl, x, ref, &t);
    s->kl += w * t.value;
    g += c.kl_coef * w * t.deriv;
  }
  return g;
}

// One node of the compact form (n trainable occurrences, n_pos / n_neg of them with A > 0 / A < 0): adds to the
// sums, returns dloss/dlp.
TP_HD double Node(const tp_loss_config& c, double x, double old, double P, double Q, double kl_w, double ref, int32_t n,
                  int32_t n_pos, int32_t n_neg, Sums* s) {
  NodeTerm t;
  CompactNode(x, old, P, Q, c, &t);
  s->pg += t.value;
  double g = t.deriv;
  const double om = old - x;
  s->Add(n - n_pos - n_neg, c.policy == TP_POLICY_CISPO ? t.pos_flags : 0, t.ratio, om);
  s->Add(n_pos, t.pos_flags, t.ratio, om);
  s->Add(n_neg, t.neg_flags, t.ratio, om);
  if (c.kl != TP_KL_NONE) {
    Term k;
    Kl(c.kl, x, ref, &k);
    s->kl += kl_w * k.value;
    g += c.kl_coef * kl_w * k.deriv;
  }
  return g;
}

}  // namespace loss
}  // namespace treepack

#endif  // TREEPACK_LOSS_MATH_H
