// Argument plumbing of the loss functions, shared by the CPU addon (loss_binding.cc) and the CUDA addon
// (cuda_binding.cc): both take the same typed arrays and return the same metrics object. Inputs are validated in
// TypeScript (src/backend/ops.ts); here only types and lengths are re-checked.
#ifndef TREEPACK_NAPI_LOSS_BINDING_H
#define TREEPACK_NAPI_LOSS_BINDING_H

#include <napi.h>

#include <string>

#include "../core/treepack.h"
#include "addon_util.h"

namespace treepack {

struct LossArgs {
  tp_loss_config config;
  int64_t S = 0, M = 0, N = 0;
  const int32_t *seq_offsets = nullptr, *seq_positions = nullptr;
  const uint8_t* loss_mask = nullptr;
  const float *advantages = nullptr, *old_logprobs = nullptr, *ref_logprobs = nullptr, *rollout_logprobs = nullptr;
  const float* seq_weight = nullptr;
  const int32_t* turn_ids = nullptr;
  const float* lp = nullptr;
  float* grad = nullptr;
};

struct CompactArgs {
  tp_loss_config config;
  int64_t N = 0;
  const float *lp = nullptr, *old = nullptr, *ref = nullptr, *pos_weight = nullptr, *neg_weight = nullptr,
              *kl_weight = nullptr;
  const int32_t *n_train = nullptr, *n_pos = nullptr, *n_neg = nullptr;
  float* grad = nullptr;
};

inline bool IsTyped(const Napi::Value& v, napi_typedarray_type type) {
  return v.IsTypedArray() && v.As<Napi::TypedArray>().TypedArrayType() == type;
}

inline size_t Length(const Napi::Value& v) { return v.As<Napi::TypedArray>().ElementLength(); }

template <typename T>
T* DataOf(const Napi::Value& v) {
  if (!v.IsTypedArray()) return nullptr;
  Napi::TypedArray a = v.As<Napi::TypedArray>();
  return reinterpret_cast<T*>(static_cast<uint8_t*>(a.ArrayBuffer().Data()) + a.ByteOffset());
}

// The config as a Float64Array of tp_loss_config's fields in order (configVector in src/backend/abi.ts; the order
// is abi.h's TP_LOSS_CONFIG_FIELDS, generated from the same table).
//
// Every message names the parameter as LossAddon (src/backend/loss-addon.ts) declares it, in the position it
// declares it: test/loss-addon.test.ts reads that interface and fails on any drift between the two.
inline bool ReadLossConfig(const Napi::Value& v, tp_loss_config* c) {
  if (!IsTyped(v, napi_float64_array) || Length(v) != TP_LOSS_CONFIG_NUM_FIELDS) return false;
  const double* a = DataOf<double>(v);
  size_t k = 0;
#define TP_READ_FIELD(type, name) c->name = static_cast<type>(a[k++]);
  TP_LOSS_CONFIG_FIELDS(TP_READ_FIELD)
#undef TP_READ_FIELD
  return true;
}

// (config, seq_offsets, seq_positions, loss_mask, advantages, old, ref|null, rollout|null, seq_weight|null,
//  turn_ids|null, lp, grad|null)
// Returns false with a TreepackError pending.
inline bool ParseLossArgs(const Napi::CallbackInfo& info, LossArgs* a) {
  Napi::Env env = info.Env();
  auto fail = [&env](const std::string& m) {
    ThrowTreepackError(env, "E_ARG", m);
    return false;
  };
  if (info.Length() != 12) return fail("Expected 12 arguments for loss");
  if (!ReadLossConfig(info[0], &a->config)) {
    return fail("Expected a Float64Array of the loss config's fields for config");
  }
  if (!IsTyped(info[1], napi_int32_array) || Length(info[1]) < 1) return fail("Expected an Int32Array for seq_offsets");
  if (!IsTyped(info[2], napi_int32_array)) return fail("Expected an Int32Array for seq_positions");
  a->S = static_cast<int64_t>(Length(info[1])) - 1;
  a->M = static_cast<int64_t>(Length(info[2]));
  a->seq_offsets = DataOf<int32_t>(info[1]);
  a->seq_positions = DataOf<int32_t>(info[2]);
  if (a->seq_offsets[a->S] != a->M) return fail("seq_offsets[S] must equal M");
  if (!IsTyped(info[3], napi_uint8_array) || static_cast<int64_t>(Length(info[3])) != a->M) {
    return fail("Expected a Uint8Array of length M for loss_mask");
  }
  a->loss_mask = DataOf<uint8_t>(info[3]);
  const char* names[] = {"advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"};
  const float** fields[] = {&a->advantages, &a->old_logprobs, &a->ref_logprobs, &a->rollout_logprobs};
  for (int k = 0; k < 4; k++) {
    const Napi::Value v = info[4 + k];
    const bool needed = k < 2 || (k == 2 && a->config.kl != TP_KL_NONE) || (k == 3 && a->config.tis != TP_TIS_NONE);
    if (!needed && v.IsNull()) continue;
    if (!IsTyped(v, napi_float32_array) || static_cast<int64_t>(Length(v)) != a->M) {
      return fail(std::string("Expected a Float32Array of length M for ") + names[k]);
    }
    *fields[k] = DataOf<float>(v);
  }
  if (!info[8].IsNull()) {
    if (!IsTyped(info[8], napi_float32_array) || static_cast<int64_t>(Length(info[8])) != a->S) {
      return fail("Expected a Float32Array of length S for seq_weight");
    }
    a->seq_weight = DataOf<float>(info[8]);
  }
  const bool turns = a->config.aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN;
  if ((turns && a->M > 0) || !info[9].IsNull()) {
    if (!IsTyped(info[9], napi_int32_array) || static_cast<int64_t>(Length(info[9])) != a->M) {
      return fail("Expected an Int32Array of length M for turn_ids");
    }
    a->turn_ids = DataOf<int32_t>(info[9]);
  }
  if (!IsTyped(info[10], napi_float32_array)) return fail("Expected a Float32Array for lp");
  a->N = static_cast<int64_t>(Length(info[10]));
  a->lp = DataOf<float>(info[10]);
  if (!info[11].IsNull()) {
    if (!IsTyped(info[11], napi_float32_array) || static_cast<int64_t>(Length(info[11])) != a->N) {
      return fail("Expected a Float32Array of length N for grad");
    }
    a->grad = DataOf<float>(info[11]);
  }
  return true;
}

// (config, lp, old, ref|null, pos_weight, neg_weight, kl_weight, n_train, n_pos, n_neg, grad|null)
inline bool ParseCompactArgs(const Napi::CallbackInfo& info, CompactArgs* a) {
  Napi::Env env = info.Env();
  auto fail = [&env](const std::string& m) {
    ThrowTreepackError(env, "E_ARG", m);
    return false;
  };
  if (info.Length() != 11) return fail("Expected 11 arguments for lossCompact");
  if (!ReadLossConfig(info[0], &a->config)) {
    return fail("Expected a Float64Array of the loss config's fields for config");
  }
  if (!IsTyped(info[1], napi_float32_array)) return fail("Expected a Float32Array for lp");
  a->N = static_cast<int64_t>(Length(info[1]));
  const char* float_names[] = {"lp", "old", "ref", "pos_weight", "neg_weight", "kl_weight"};
  const float** floats[] = {&a->lp, &a->old, &a->ref, &a->pos_weight, &a->neg_weight, &a->kl_weight};
  for (int k = 1; k <= 6; k++) {
    if (k == 3 && info[k].IsNull() && a->config.kl == TP_KL_NONE) continue;
    if (!IsTyped(info[k], napi_float32_array) || static_cast<int64_t>(Length(info[k])) != a->N) {
      return fail(std::string("Expected a Float32Array of length N for ") + float_names[k - 1]);
    }
    *floats[k - 1] = DataOf<float>(info[k]);
  }
  const char* int_names[] = {"n_train", "n_pos", "n_neg"};
  const int32_t** ints[] = {&a->n_train, &a->n_pos, &a->n_neg};
  for (int k = 7; k <= 9; k++) {
    if (!IsTyped(info[k], napi_int32_array) || static_cast<int64_t>(Length(info[k])) != a->N) {
      return fail(std::string("Expected an Int32Array of length N for ") + int_names[k - 7]);
    }
    *ints[k - 7] = DataOf<int32_t>(info[k]);
  }
  if (!info[10].IsNull()) {
    if (!IsTyped(info[10], napi_float32_array) || static_cast<int64_t>(Length(info[10])) != a->N) {
      return fail("Expected a Float32Array of length N for grad");
    }
    a->grad = DataOf<float>(info[10]);
  }
  return true;
}

inline Napi::Value LossMetricsObject(Napi::Env env, const tp_loss_metrics& m) {
  Napi::Object o = Napi::Object::New(env);
#define TP_SET_METRIC(type, name) o.Set(#name, static_cast<double>(m.name));
  TP_LOSS_METRICS_FIELDS(TP_SET_METRIC)
#undef TP_SET_METRIC
  return o;
}

}  // namespace treepack

// Registers loss() and lossCompact() of the CPU addon.
void RegisterLoss(Napi::Env env, Napi::Object exports);

#endif  // TREEPACK_NAPI_LOSS_BINDING_H
