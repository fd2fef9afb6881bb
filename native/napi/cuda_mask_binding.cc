// Mask lowerings of the CUDA addon: typed-array plumbing around the host wrappers of native/cuda/treepack_cuda.h.
// Each returns {data, kernelMs}: the lowering and the time its kernels took on the GPU (the bench reports it).
#include <string>

#include "../cuda/treepack_cuda.h"
#include "addon_util.h"
#include "cuda_mask_binding.h"
#include "mask_arrays.h"

namespace {

#define TP_REQUIRE_CUDA(env, code) \
  TP_REQUIRE(env, (code) == 0, "E_BACKEND", "CUDA error " + std::to_string(code) + ": " + tp_cuda_error_string(code))

Napi::Object WithTime(Napi::Env env, Napi::Value data, float ms) {
  Napi::Object result = Napi::Object::New(env);
  result.Set("data", data);
  result.Set("kernelMs", Napi::Number::New(env, ms));
  return result;
}

// maskDense(subtree_end) -> {data: Uint8Array [N * N], kernelMs}
Napi::Value MaskDense(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  TP_REQUIRE(env, info.Length() >= 1 && treepack::IsInt32Array(info[0]), "E_ARG", "Expected an Int32Array for subtree_end");
  Napi::Int32Array se = info[0].As<Napi::Int32Array>();
  const int64_t n = static_cast<int64_t>(se.ElementLength());
  Napi::Uint8Array out = Napi::Uint8Array::New(env, static_cast<size_t>(n * n));
  TP_RETURN_IF_PENDING(env);
  float ms = 0;
  const int code = tp_cuda_mask_dense_host(se.Data(), n, out.Data(), &ms);
  TP_REQUIRE_CUDA(env, code);
  return WithTime(env, out, ms);
}

// maskBits(subtree_end) -> {data: Uint32Array [N * ceil(N / 32)], kernelMs}
Napi::Value MaskBits(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  TP_REQUIRE(env, info.Length() >= 1 && treepack::IsInt32Array(info[0]), "E_ARG", "Expected an Int32Array for subtree_end");
  Napi::Int32Array se = info[0].As<Napi::Int32Array>();
  const int64_t n = static_cast<int64_t>(se.ElementLength());
  Napi::Uint32Array out = Napi::Uint32Array::New(env, static_cast<size_t>(n * ((n + 31) / 32)));
  TP_RETURN_IF_PENDING(env);
  float ms = 0;
  const int code = tp_cuda_mask_bits_host(se.Data(), n, out.Data(), &ms);
  TP_REQUIRE_CUDA(env, code);
  return WithTime(env, out, ms);
}

// maskBlocks(subtree_end, blockSize) -> {data: {block_kv_num_blocks, ...}, kernelMs}
Napi::Value MaskBlocks(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::BlockMaskCall c;
  if (!c.Read(info)) return env.Undefined();
  float ms = 0;
  const int code = tp_cuda_mask_blocks_host(c.subtree_end.Data(), c.n, c.block, c.out.kv_num.Data(),
                                            c.out.kv_idx.Data(), c.out.full_num.Data(), c.out.full_idx.Data(), &ms);
  TP_REQUIRE_CUDA(env, code);
  return WithTime(env, c.out.ToObject(env), ms);
}

}  // namespace

void RegisterCudaMask(Napi::Env env, Napi::Object exports) {
  exports.Set("maskDense", Napi::Function::New(env, MaskDense, "maskDense"));
  exports.Set("maskBits", Napi::Function::New(env, MaskBits, "maskBits"));
  exports.Set("maskBlocks", Napi::Function::New(env, MaskBlocks, "maskBlocks"));
}
