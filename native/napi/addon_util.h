// Argument checks and TreepackError throwing shared by the CPU and CUDA addons: a status of either C ABI becomes
// the same TreepackError.
#ifndef TREEPACK_NAPI_ADDON_UTIL_H
#define TREEPACK_NAPI_ADDON_UTIL_H

#include <napi.h>

#include <cstdint>
#include <string>

#include "../core/abi.h"

namespace treepack {

struct AddonData {
  Napi::FunctionReference error_class;  // TreepackError, handed over by init() when the loader requires the addon
};

// `new TreepackError(code, message)`, so errors look the same whichever backend ran; a plain Error whose message
// starts with the code when init() was never called.
inline void ThrowTreepackError(Napi::Env env, const char* code, const std::string& message) {
  AddonData* data = env.GetInstanceData<AddonData>();
  if (data == nullptr || data->error_class.IsEmpty()) {
    Napi::Error::New(env, std::string(code) + ": " + message).ThrowAsJavaScriptException();
    return;
  }
  Napi::Object error = data->error_class.New({Napi::String::New(env, code), Napi::String::New(env, message)});
  if (!env.IsExceptionPending()) Napi::Error(env, error).ThrowAsJavaScriptException();
}

// The TreepackError code of a status (abi.h's table).
inline const char* StatusErrorCode(int status) {
  switch (status) {
#define TP_ERROR_CASE(status, message, error) \
  case status:                                \
    return error;
    TP_STATUS_TABLE(TP_ERROR_CASE)
#undef TP_ERROR_CASE
    default:
      return "E_BACKEND";
  }
}

inline bool IsInt32Array(const Napi::Value& v) {
  return v.IsTypedArray() && v.As<Napi::TypedArray>().TypedArrayType() == napi_int32_array;
}

// Byte ranges of `a[0..na)` and `b[0..nb)` share memory.
inline bool Overlaps(const int32_t* a, size_t na, const int32_t* b, size_t nb) {
  if (na == 0 || nb == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + nb * sizeof(int32_t) && pb < pa + na * sizeof(int32_t);
}

// Stores the error class that later errors are constructed from.
inline Napi::Value Init(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsFunction()) {
    Napi::TypeError::New(env, "init expects the TreepackError class").ThrowAsJavaScriptException();
    return env.Undefined();
  }
  env.GetInstanceData<AddonData>()->error_class = Napi::Persistent(info[0].As<Napi::Function>());
  return env.Undefined();
}

}  // namespace treepack

// Throws TreepackError(code, message) and returns from the calling binding function when `cond` is false.
#define TP_REQUIRE(env, cond, code, message)              \
  do {                                                    \
    if (!(cond)) {                                        \
      ::treepack::ThrowTreepackError(env, code, message); \
      return (env).Undefined();                           \
    }                                                     \
  } while (0)

// Returns from the calling binding function when a JS call made through node-addon-api left an exception pending.
#define TP_RETURN_IF_PENDING(env)                             \
  do {                                                        \
    if ((env).IsExceptionPending()) return (env).Undefined(); \
  } while (0)

#endif  // TREEPACK_NAPI_ADDON_UTIL_H
