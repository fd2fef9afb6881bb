// The CUDA addon: the device layer of native/cuda/treepack_cuda.h for JS. Loads and answers without a GPU or driver
// (static cudart); callers check deviceInfo().code before using the kernels.
#include <string>
#include <vector>

#include "../cuda/treepack_cuda.h"
#include "addon_util.h"
#include "cuda_mask_binding.h"
#include "loss_binding.h"

namespace {

// Throws the TreepackError of a status: for a CUDA runtime failure, the CUDA error and its name.
#define TP_REQUIRE_CUDA_OK(env, status) \
  TP_REQUIRE(env, (status) == TP_OK, treepack::StatusErrorCode(status), CudaStatusMessage(status))

std::string CudaStatusMessage(int status) {
  if (status != TP_ERR_DEVICE && status != TP_ERR_ALLOC) return tp_cuda_status_string(status);
  const int code = tp_cuda_last_error();
  return "CUDA error " + std::to_string(code) + ": " + tp_cuda_error_string(code);
}

// Enough for any single host; the count reported is the true one.
constexpr int32_t kMaxDevices = 64;

// deviceInfo() -> {code, message, runtimeVersion, driverVersion, devices: [{name, major, minor, ...}]}
Napi::Value DeviceInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::vector<tp_cuda_device> devices(kMaxDevices);
  int32_t runtime_version = 0, driver_version = 0, count = 0;
  const int status = tp_cuda_device_info(&runtime_version, &driver_version, &count, devices.data(), kMaxDevices);
  // The CUDA runtime's code (35 no driver, 100 no device), which says more than TP_ERR_DEVICE.
  const int code = status == TP_OK ? 0 : status == TP_ERR_DEVICE ? tp_cuda_last_error() : -status;
  Napi::Object result = Napi::Object::New(env);
  result.Set("code", Napi::Number::New(env, code));
  result.Set("message", Napi::String::New(env, code >= 0 ? tp_cuda_error_string(code) : tp_cuda_status_string(status)));
  result.Set("runtimeVersion", Napi::Number::New(env, runtime_version));
  result.Set("driverVersion", Napi::Number::New(env, driver_version));
  Napi::Array list = Napi::Array::New(env);
  for (int32_t d = 0; code == 0 && d < count && d < kMaxDevices; d++) {
    Napi::Object dev = Napi::Object::New(env);
    dev.Set("name", Napi::String::New(env, devices[d].name));
    dev.Set("major", Napi::Number::New(env, devices[d].major));
    dev.Set("minor", Napi::Number::New(env, devices[d].minor));
    dev.Set("totalGlobalMem", Napi::Number::New(env, static_cast<double>(devices[d].total_global_mem)));
    dev.Set("multiProcessorCount", Napi::Number::New(env, devices[d].multiprocessor_count));
    list.Set(static_cast<uint32_t>(d), dev);
  }
  result.Set("devices", list);
  return result;
}

// gatherI32(src: Int32Array, idx: Int32Array) -> Int32Array, dst[i] = src[idx[i]] computed on the current GPU.
Napi::Value GatherI32(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  TP_REQUIRE(env, info.Length() >= 2 && treepack::IsInt32Array(info[0]), "E_ARG", "Expected an Int32Array for src");
  TP_REQUIRE(env, treepack::IsInt32Array(info[1]), "E_ARG", "Expected an Int32Array for idx");
  Napi::Int32Array src = info[0].As<Napi::Int32Array>();
  Napi::Int32Array idx = info[1].As<Napi::Int32Array>();
  Napi::Int32Array dst = Napi::Int32Array::New(env, idx.ElementLength());
  TP_RETURN_IF_PENDING(env);
  const int status = tp_cuda_gather_i32_host(src.Data(), static_cast<int64_t>(src.ElementLength()), idx.Data(),
                                             static_cast<int64_t>(idx.ElementLength()), dst.Data());
  TP_REQUIRE_CUDA_OK(env, status);
  return dst;
}

// loss(...) and lossCompact(...): the CPU addon's signatures (loss_binding.h), run on the current GPU.
Napi::Value Loss(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::LossArgs a;
  if (!treepack::ParseLossArgs(info, &a)) return env.Undefined();
  tp_loss_metrics m;
  const int status =
      tp_cuda_loss_host(&a.config, a.S, a.seq_offsets, a.M, a.seq_positions, a.loss_mask, a.advantages, a.old_logprobs,
                        a.ref_logprobs, a.rollout_logprobs, a.seq_weight, a.turn_ids, a.N, a.lp, a.grad, &m);
  TP_REQUIRE_CUDA_OK(env, status);
  return treepack::LossMetricsObject(env, m);
}

Napi::Value LossCompact(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::CompactArgs a;
  if (!treepack::ParseCompactArgs(info, &a)) return env.Undefined();
  tp_loss_metrics m;
  const int status = tp_cuda_loss_compact_host(&a.config, a.N, a.lp, a.old, a.ref, a.pos_weight, a.neg_weight,
                                               a.kl_weight, a.n_train, a.n_pos, a.n_neg, a.grad, &m);
  TP_REQUIRE_CUDA_OK(env, status);
  return treepack::LossMetricsObject(env, m);
}

Napi::Value Version(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), TP_VERSION); }

Napi::Value Abi(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), tp_cuda_abi()); }

Napi::Object InitModule(Napi::Env env, Napi::Object exports) {
  env.SetInstanceData(new treepack::AddonData());
  exports.Set("deviceInfo", Napi::Function::New(env, DeviceInfo, "deviceInfo"));
  exports.Set("gatherI32", Napi::Function::New(env, GatherI32, "gatherI32"));
  exports.Set("loss", Napi::Function::New(env, Loss, "loss"));
  exports.Set("lossCompact", Napi::Function::New(env, LossCompact, "lossCompact"));
  exports.Set("version", Napi::Function::New(env, Version, "version"));
  exports.Set("abi", Napi::Function::New(env, Abi, "abi"));
  exports.Set("init", Napi::Function::New(env, treepack::Init, "init"));
  RegisterCudaMask(env, exports);
  return exports;
}

}  // namespace

NODE_API_MODULE(treepack_cuda, InitModule)
