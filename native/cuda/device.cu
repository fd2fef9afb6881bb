// Device discovery: what a caller checks before choosing the CUDA backend.
#include <cuda_runtime.h>

#include <cstring>

#include "treepack_cuda.h"

extern "C" {

const char* tp_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int tp_cuda_device_info(int32_t* runtime_version, int32_t* driver_version, int32_t* count, tp_cuda_device* devices,
                        int32_t capacity) {
  if (runtime_version == nullptr || driver_version == nullptr || count == nullptr || capacity < 0 ||
      (devices == nullptr && capacity > 0)) {
    return cudaErrorInvalidValue;
  }
  *count = 0;
  int v = 0;
  cudaRuntimeGetVersion(&v);
  *runtime_version = v;
  v = 0;
  cudaDriverGetVersion(&v);  // 0 without a driver, and that is the answer rather than an error
  *driver_version = v;
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return err;
  *count = n;
  for (int d = 0; d < n && d < capacity; d++) {
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, d);
    if (err != cudaSuccess) return err;
    tp_cuda_device& out = devices[d];
    std::memset(&out, 0, sizeof out);
    std::strncpy(out.name, prop.name, sizeof out.name - 1);
    out.major = prop.major;
    out.minor = prop.minor;
    out.multiprocessor_count = prop.multiProcessorCount;
    out.total_global_mem = static_cast<int64_t>(prop.totalGlobalMem);
  }
  return cudaSuccess;
}

}  // extern "C"
