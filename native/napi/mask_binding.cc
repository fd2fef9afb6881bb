// Mask lowerings for JS: typed-array plumbing around native/core/mask.h. Shapes and the forest's consistency are
// checked in TS (src/mask/validate.ts); here only what the C ABI needs to be called safely.
#include <string>

#include "../core/treepack.h"
#include "addon_util.h"
#include "mask_arrays.h"
#include "mask_binding.h"

namespace {

#define TP_REQUIRE_OK(env, status) \
  TP_REQUIRE(env, (status) == TP_OK, treepack::StatusErrorCode(status), tp_status_string(status))

// The tree arguments: parent (and subtree_end, when `with_end`) as Int32Arrays of one length.
struct Tree {
  Napi::Int32Array parent, subtree_end;
  int64_t n = 0;
};

bool ReadTree(const Napi::CallbackInfo& info, bool with_end, Tree* t) {
  Napi::Env env = info.Env();
  if (info.Length() < (with_end ? 2u : 1u) || !treepack::IsInt32Array(info[0]) ||
      (with_end && !treepack::IsInt32Array(info[1]))) {
    treepack::ThrowTreepackError(
        env, "E_ARG",
        with_end ? "Expected Int32Arrays for parent and subtree_end" : "Expected an Int32Array for parent");
    return false;
  }
  t->parent = info[0].As<Napi::Int32Array>();
  t->n = static_cast<int64_t>(t->parent.ElementLength());
  if (with_end) {
    t->subtree_end = info[1].As<Napi::Int32Array>();
    if (static_cast<int64_t>(t->subtree_end.ElementLength()) != t->n) {
      treepack::ThrowTreepackError(env, "E_INPUT", "subtree_end and parent differ in length");
      return false;
    }
  }
  return true;
}

// maskDense(parent, subtree_end) -> Uint8Array [N * N]
Napi::Value MaskDense(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Tree t;
  if (!ReadTree(info, true, &t)) return env.Undefined();
  Napi::Uint8Array out = Napi::Uint8Array::New(env, static_cast<size_t>(t.n * t.n));
  TP_RETURN_IF_PENDING(env);
  TP_REQUIRE_OK(env, tp_mask_dense(t.parent.Data(), t.subtree_end.Data(), t.n, out.Data()));
  return out;
}

// maskBits(parent, subtree_end) -> Uint32Array [N * ceil(N / 32)]
Napi::Value MaskBits(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Tree t;
  if (!ReadTree(info, true, &t)) return env.Undefined();
  Napi::Uint32Array out = Napi::Uint32Array::New(env, static_cast<size_t>(t.n * ((t.n + 31) / 32)));
  TP_RETURN_IF_PENDING(env);
  TP_REQUIRE_OK(env, tp_mask_bits(t.parent.Data(), t.subtree_end.Data(), t.n, out.Data()));
  return out;
}

// maskBlocks(subtree_end, blockSize) -> {block_kv_num_blocks, block_kv_indices, block_full_kv_num_blocks, ...}
Napi::Value MaskBlocks(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  treepack::BlockMaskCall c;
  if (!c.Read(info)) return env.Undefined();
  TP_REQUIRE_OK(env, tp_mask_blocks(c.subtree_end.Data(), c.n, c.block, c.out.kv_num.Data(), c.out.kv_idx.Data(),
                                    c.out.full_num.Data(), c.out.full_idx.Data()));
  return c.out.ToObject(env);
}

// maskSlices(parent, subtree_end) -> Int32Array [K * 5]
Napi::Value MaskSlices(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Tree t;
  if (!ReadTree(info, true, &t)) return env.Undefined();
  // Agent forests need few slices (long runs): try a small array first, then the exact count.
  int64_t capacity = 4096, count = 0;
  for (;;) {
    Napi::Int32Array out = Napi::Int32Array::New(env, static_cast<size_t>(5 * capacity));
    TP_RETURN_IF_PENDING(env);
    const int rc = tp_mask_slices(t.parent.Data(), t.subtree_end.Data(), t.n, out.Data(), capacity, &count);
    if (rc == TP_ERR_CAPACITY) {
      capacity = count;
      continue;
    }
    TP_REQUIRE_OK(env, rc);
    return Napi::Int32Array::New(env, static_cast<size_t>(5 * count), out.ArrayBuffer(), 0);
  }
}

// maskCuSeqlens(parent) -> Int32Array [R + 1]
Napi::Value MaskCuSeqlens(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Tree t;
  if (!ReadTree(info, false, &t)) return env.Undefined();
  Napi::Int32Array out = Napi::Int32Array::New(env, static_cast<size_t>(t.n + 1));
  TP_RETURN_IF_PENDING(env);
  int64_t roots = 0;
  TP_REQUIRE_OK(env, tp_mask_cu_seqlens(t.parent.Data(), t.n, out.Data(), t.n + 1, &roots));
  return Napi::Int32Array::New(env, static_cast<size_t>(roots + 1), out.ArrayBuffer(), 0);
}

}  // namespace

void RegisterMask(Napi::Env env, Napi::Object exports) {
  exports.Set("maskDense", Napi::Function::New(env, MaskDense, "maskDense"));
  exports.Set("maskBits", Napi::Function::New(env, MaskBits, "maskBits"));
  exports.Set("maskBlocks", Napi::Function::New(env, MaskBlocks, "maskBlocks"));
  exports.Set("maskSlices", Napi::Function::New(env, MaskSlices, "maskSlices"));
  exports.Set("maskCuSeqlens", Napi::Function::New(env, MaskCuSeqlens, "maskCuSeqlens"));
}
