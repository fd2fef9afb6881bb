// Registration of the mask lowerings (mask_binding.cc) on the CPU addon's exports.
#ifndef TREEPACK_NAPI_MASK_BINDING_H
#define TREEPACK_NAPI_MASK_BINDING_H

#include <napi.h>

void RegisterMask(Napi::Env env, Napi::Object exports);

#endif  // TREEPACK_NAPI_MASK_BINDING_H
