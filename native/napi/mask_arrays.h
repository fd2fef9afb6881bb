// Shared by the CPU and CUDA addons: the four typed arrays of a FlexAttention block mask, allocated for JS and
// returned under their contract names.
#ifndef TREEPACK_NAPI_MASK_ARRAYS_H
#define TREEPACK_NAPI_MASK_ARRAYS_H

#include <napi.h>

#include <string>

#include "../core/treepack.h"
#include "addon_util.h"

namespace treepack {

struct BlockMaskArrays {
  Napi::Int32Array kv_num, kv_idx, full_num, full_idx;

  // False with a JS exception pending when an allocation failed.
  bool Allocate(Napi::Env env, int64_t nb) {
    const size_t rows = static_cast<size_t>(nb), all = rows * rows;
    kv_num = Napi::Int32Array::New(env, rows);
    if (env.IsExceptionPending()) return false;
    kv_idx = Napi::Int32Array::New(env, all);
    if (env.IsExceptionPending()) return false;
    full_num = Napi::Int32Array::New(env, rows);
    if (env.IsExceptionPending()) return false;
    full_idx = Napi::Int32Array::New(env, all);
    return !env.IsExceptionPending();
  }

  Napi::Object ToObject(Napi::Env env) const {
    Napi::Object result = Napi::Object::New(env);
    result.Set("block_kv_num_blocks", kv_num);
    result.Set("block_kv_indices", kv_idx);
    result.Set("block_full_kv_num_blocks", full_num);
    result.Set("block_full_kv_indices", full_idx);
    return result;
  }
};

// The arguments (subtree_end: Int32Array, blockSize: number) of maskBlocks on either addon, and its outputs.
struct BlockMaskCall {
  Napi::Int32Array subtree_end;
  int64_t n = 0;
  int32_t block = 0;
  BlockMaskArrays out;

  // False with a TreepackError (or allocation error) pending when the arguments are wrong.
  bool Read(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (info.Length() < 2 || !IsInt32Array(info[0]) || !info[1].IsNumber()) {
      ThrowTreepackError(env, "E_ARG", "Expected an Int32Array for subtree_end and a number for blockSize");
      return false;
    }
    const int64_t b = info[1].As<Napi::Number>().Int64Value();
    if (b < 1 || b > INT32_MAX) {
      ThrowTreepackError(env, "E_ARG", "Expected a positive block size but received " + std::to_string(b));
      return false;
    }
    subtree_end = info[0].As<Napi::Int32Array>();
    n = static_cast<int64_t>(subtree_end.ElementLength());
    block = static_cast<int32_t>(b);
    return out.Allocate(env, (n + b - 1) / b);
  }
};

}  // namespace treepack

#endif  // TREEPACK_NAPI_MASK_ARRAYS_H
