// Mask lowerings of the CUDA addon: typed-array plumbing around the host wrappers of native/cuda/treepack_cuda.h.
// Each returns {data, kernelMs}: the lowering and the time its kernels took on the GPU (the bench reports it).
#include <string>

#include "../cuda/treepack_cuda.h"
#include "addon_util.h"
#include "cuda_mask_binding.h"
#include "mask_arrays.h"

namespace {

// As cuda_binding.cc: a CUDA runtime failure names the CUDA error, any other status its message.
#define TP_REQUIRE_CUDA(env, status)                                                                                 \
  TP_REQUIRE(                                                                                                        \
      env, (status) == TP_OK, treepack::StatusErrorCode(status),                                                     \
      (status) == TP_ERR_DEVICE || (status) == TP_ERR_ALLOC                                                          \
          ? "CUDA error " + std::to_string(tp_cuda_last_error()) + ": " + tp_cuda_error_string(tp_cuda_last_error()) \
          : std::string(tp_cuda_status_string(status)))

Napi::Object WithTime(Napi::Env env, Napi::Value data, float ms) {
  Napi::Object result = Napi::Object::New(env);
  result.Set("data", data);
  result.Set("kernelMs", Napi::Number::New(env, ms));
  return result;
}

// (parent, subtree_end): Int32Arrays of one length, as the CPU addon's mask functions take them.
bool ReadTree(const Napi::CallbackInfo& info, Napi::Int32Array* parent, Napi::Int32Array* se) {
  Napi::Env env = info.Env();
  if (info.Length() < 2 || !treepack::IsInt32Array(info[0]) || !treepack::IsInt32Array(info[1])) {
    treepack::ThrowTreepackError(env, "E_ARG", "Expected Int32Arrays for parent and subtree_end");
    return false;
  }
  *parent = info[0].As<Napi::Int32Array>();
  *se = info[1].As<Napi::Int32Array>();
  if (parent->ElementLength() != se->ElementLength()) {
    treepack::ThrowTreepackError(env, "E_INPUT", "subtree_end and parent differ in length");
    return false;
  }
  return true;
}

// maskDense(parent, subtree_end) -> {data: Uint8Array [N * N], kernelMs}
Napi::Value MaskDense(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Int32Array parent, se;
  if (!ReadTree(info, &parent, &se)) return env.Undefined();
  const int64_t n = static_cast<int64_t>(se.ElementLength());
  Napi::Uint8Array out = Napi::Uint8Array::New(env, static_cast<size_t>(n * n));
  TP_RETURN_IF_PENDING(env);
  float ms = 0;
  const int status = tp_cuda_mask_dense_host(parent.Data(), se.Data(), n, out.Data(), &ms);
  TP_REQUIRE_CUDA(env, status);
  return WithTime(env, out, ms);
}

// maskBits(parent, subtree_end) -> {data: Uint32Array [N * ceil(N / 32)], kernelMs}
Napi::Value MaskBits(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Int32Array parent, se;
  if (!ReadTree(info, &parent, &se)) return env.Undefined();
  const int64_t n = static_cast<int64_t>(se.ElementLength());
  Napi::Uint32Array out = Napi::Uint32Array::New(env, static_cast<size_t>(n * ((n + 31) / 32)));
  TP_RETURN_IF_PENDING(env);
  float ms = 0;
  const int status = tp_cuda_mask_bits_host(parent.Data(), se.Data(), n, out.Data(), &ms);
  TP_REQUIRE_CUDA(env, status);
  return WithTime(env, out, ms);
}

// maskBlocks(subtree_end, blockSize) -> {data: {block_kv_num_blocks, ...}, kernelMs}
Napi::Value MaskBlocks(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::BlockMaskCall c;
  if (!c.Read(info)) return env.Undefined();
  float ms = 0;
  const int status = tp_cuda_mask_blocks_host(c.subtree_end.Data(), c.n, c.block, c.out.kv_num.Data(),
                                              c.out.kv_idx.Data(), c.out.full_num.Data(), c.out.full_idx.Data(), &ms);
  TP_REQUIRE_CUDA(env, status);
  return WithTime(env, c.out.ToObject(env), ms);
}

}  // namespace

void RegisterCudaMask(Napi::Env env, Napi::Object exports) {
  exports.Set("maskDense", Napi::Function::New(env, MaskDense, "maskDense"));
  exports.Set("maskBits", Napi::Function::New(env, MaskBits, "maskBits"));
  exports.Set("maskBlocks", Napi::Function::New(env, MaskBlocks, "maskBlocks"));
}
