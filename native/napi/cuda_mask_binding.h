// Registration of the CUDA mask lowerings (cuda_mask_binding.cc) on the CUDA addon's exports.
#ifndef TREEPACK_NAPI_CUDA_MASK_BINDING_H
#define TREEPACK_NAPI_CUDA_MASK_BINDING_H

#include <napi.h>

void RegisterCudaMask(Napi::Env env, Napi::Object exports);

#endif  // TREEPACK_NAPI_CUDA_MASK_BINDING_H
