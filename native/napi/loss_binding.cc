// The loss functions of the CPU addon: tp_loss / tp_loss_compact (native/core/loss.h) on typed arrays.
#include "loss_binding.h"

namespace {

Napi::Value Loss(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::LossArgs a;
  if (!treepack::ParseLossArgs(info, &a)) return env.Undefined();
  tp_loss_metrics m;
  const int status =
      tp_loss(&a.config, a.S, a.seq_offsets, a.M, a.seq_positions, a.loss_mask, a.advantages, a.old_logprobs,
              a.ref_logprobs, a.rollout_logprobs, a.seq_weight, a.turn_ids, a.N, a.lp, a.grad, &m);
  TP_REQUIRE(env, status == TP_OK, treepack::StatusErrorCode(status), tp_status_string(status));
  return treepack::LossMetricsObject(env, m);
}

Napi::Value LossCompact(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::CompactArgs a;
  if (!treepack::ParseCompactArgs(info, &a)) return env.Undefined();
  tp_loss_metrics m;
  const int status = tp_loss_compact(&a.config, a.N, a.lp, a.old, a.ref, a.pos_weight, a.neg_weight, a.kl_weight,
                                     a.n_train, a.n_pos, a.n_neg, a.grad, &m);
  TP_REQUIRE(env, status == TP_OK, treepack::StatusErrorCode(status), tp_status_string(status));
  return treepack::LossMetricsObject(env, m);
}

}  // namespace

void RegisterLoss(Napi::Env env, Napi::Object exports) {
  exports.Set("loss", Napi::Function::New(env, Loss, "loss"));
  exports.Set("lossCompact", Napi::Function::New(env, LossCompact, "lossCompact"));
}
