// The CPU addon: argument checks and typed-array plumbing around the C ABI in native/core/treepack.h.
#include <cstring>
#include <memory>
#include <string>

#include "../core/treepack.h"
#include "addon_util.h"
#include "mask_arrays.h"
#include "mask_binding.h"
#include "loss_binding.h"

namespace {

// In the order tp_plan_layout takes them, then seq_offsets, which is a copy of the input offsets.
const char* const kOutputNames[] = {"input_ids",   "position_ids",  "parent",
                                    "subtree_end", "seq_positions", "seq_offsets"};
constexpr size_t kNumOutputs = sizeof kOutputNames / sizeof kOutputNames[0];

struct Output {
  const char* name = nullptr;
  size_t need = 0;
  Napi::Value given;  // out[name], undefined when the caller gave none
  Napi::Int32Array array;
};

// packForest(tokens: Int32Array, offsets: Int32Array, out?: Partial<Forest>) -> Forest
// Arrays given in `out` (length >= the needed length) are written in place and returned as views of the needed
// length; the others are allocated here and filled directly by the core.
Napi::Value PackForest(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  TP_REQUIRE(env, info.Length() >= 2 && treepack::IsInt32Array(info[0]), "E_ARG", "Expected an Int32Array for tokens");
  TP_REQUIRE(env, treepack::IsInt32Array(info[1]), "E_ARG", "Expected an Int32Array for offsets");
  const bool has_out = info.Length() >= 3 && !info[2].IsUndefined();
  TP_REQUIRE(env, !has_out || info[2].IsObject(), "E_ARG", "Expected an object of Int32Arrays for out");

  Output outs[kNumOutputs];
  // Read `out` before taking any data pointer: a getter is JS and could detach a buffer.
  for (size_t i = 0; i < kNumOutputs; i++) {
    Output& o = outs[i];
    o.name = kOutputNames[i];
    o.given = has_out ? info[2].As<Napi::Object>().Get(o.name) : env.Undefined();
    TP_RETURN_IF_PENDING(env);
  }

  Napi::Int32Array tokens = info[0].As<Napi::Int32Array>();
  Napi::Int32Array offsets = info[1].As<Napi::Int32Array>();
  TP_REQUIRE(env, offsets.ElementLength() >= 1, "E_ARG", "Expected an Int32Array of length S+1 >= 1 for offsets");
  const size_t M = tokens.ElementLength(), S = offsets.ElementLength() - 1;

  tp_plan* raw_plan = nullptr;
  int64_t num_nodes = 0;
  int status = tp_plan_create(tokens.Data(), static_cast<int64_t>(M), offsets.Data(), static_cast<int64_t>(S),
                              &raw_plan, &num_nodes);
  TP_REQUIRE(env, status == TP_OK, treepack::StatusErrorCode(status), tp_status_string(status));
  std::unique_ptr<tp_plan, void (*)(tp_plan*)> plan(raw_plan, tp_plan_free);
  const size_t N = static_cast<size_t>(num_nodes);
  const size_t needs[kNumOutputs] = {N, N, N, N, M, S + 1};

  for (size_t i = 0; i < kNumOutputs; i++) {
    Output& o = outs[i];
    o.need = needs[i];
    if (o.given.IsUndefined()) continue;
    const std::string name = std::string("out.") + o.name;
    TP_REQUIRE(env, treepack::IsInt32Array(o.given), "E_ARG", "Expected an Int32Array for " + name);
    o.array = o.given.As<Napi::Int32Array>();
    TP_REQUIRE(env, o.array.ElementLength() >= o.need, "E_ARG",
               name + " has length " + std::to_string(o.array.ElementLength()) + " but needs at least " +
                   std::to_string(o.need));
    // Overlap with the inputs would corrupt offsets under the core's feet; with another output, the results.
    TP_REQUIRE(env,
               !treepack::Overlaps(o.array.Data(), o.need, tokens.Data(), M) &&
                   !treepack::Overlaps(o.array.Data(), o.need, offsets.Data(), S + 1),
               "E_ARG", name + " shares memory with the input tokens or offsets");
    for (size_t j = 0; j < i; j++) {
      TP_REQUIRE(env,
                 outs[j].given.IsUndefined() ||
                     !treepack::Overlaps(o.array.Data(), o.need, outs[j].array.Data(), outs[j].need),
                 "E_ARG", name + " shares memory with out." + outs[j].name);
    }
  }
  for (Output& o : outs) {
    if (!o.given.IsUndefined()) continue;
    o.array = Napi::Int32Array::New(env, o.need);
    TP_RETURN_IF_PENDING(env);
  }

  status = tp_plan_layout(plan.get(), outs[0].array.Data(), outs[1].array.Data(), outs[2].array.Data(),
                          outs[3].array.Data(), outs[4].array.Data());
  TP_REQUIRE(env, status == TP_OK, treepack::StatusErrorCode(status), tp_status_string(status));
  std::memcpy(outs[5].array.Data(), offsets.Data(), sizeof(int32_t) * (S + 1));

  Napi::Object result = Napi::Object::New(env);
  for (Output& o : outs) {
    Napi::Value value = o.array;
    if (o.array.ElementLength() != o.need) {
      value = Napi::Int32Array::New(env, o.need, o.array.ArrayBuffer(), o.array.ByteOffset());
      TP_RETURN_IF_PENDING(env);
    }
    result.Set(o.name, value);
  }
  return result;
}

Napi::Value Version(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), tp_version()); }

Napi::Value Abi(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), tp_abi()); }

Napi::Object InitModule(Napi::Env env, Napi::Object exports) {
  env.SetInstanceData(new treepack::AddonData());
  exports.Set("packForest", Napi::Function::New(env, PackForest, "packForest"));
  exports.Set("version", Napi::Function::New(env, Version, "version"));
  exports.Set("abi", Napi::Function::New(env, Abi, "abi"));
  exports.Set("init", Napi::Function::New(env, treepack::Init, "init"));
  RegisterMask(env, exports);
  RegisterLoss(env, exports);
  return exports;
}

}  // namespace

NODE_API_MODULE(treepack, InitModule)
