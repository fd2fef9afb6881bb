// Device discovery and error reporting: what a caller checks before choosing the CUDA backend, and what it reads
// after a TP_ERR_DEVICE.
#include <cuda_runtime.h>

#include <cstring>

#include "status.h"
#include "treepack_cuda.h"

namespace {

thread_local int last_cuda_error = cudaSuccess;

}  // namespace

namespace treepack {
namespace cuda {

int Fail(cudaError_t err) {
  last_cuda_error = err;
  cudaGetLastError();
  return err == cudaErrorMemoryAllocation ? TP_ERR_ALLOC : TP_ERR_DEVICE;
}

}  // namespace cuda
}  // namespace treepack

using treepack::cuda::Fail;

extern "C" {

const char* tp_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int tp_cuda_last_error(void) { return last_cuda_error; }

const char* tp_cuda_status_string(int status) { return tp_status_message(status); }

const char* tp_cuda_abi(void) { return TP_ABI; }

int tp_cuda_device_info(int32_t* runtime_version, int32_t* driver_version, int32_t* count, tp_cuda_device* devices,
                        int32_t capacity) {
  if (runtime_version == nullptr || driver_version == nullptr || count == nullptr || capacity < 0 ||
      (devices == nullptr && capacity > 0)) {
    return TP_ERR_ARG;
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
  if (err != cudaSuccess) return Fail(err);
  *count = n;
  for (int d = 0; d < n && d < capacity; d++) {
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, d);
    if (err != cudaSuccess) return Fail(err);
    tp_cuda_device& out = devices[d];
    std::memset(&out, 0, sizeof out);
    std::strncpy(out.name, prop.name, sizeof out.name - 1);
    out.major = prop.major;
    out.minor = prop.minor;
    out.multiprocessor_count = prop.multiProcessorCount;
    out.total_global_mem = static_cast<int64_t>(prop.totalGlobalMem);
  }
  return TP_OK;
}

}  // extern "C"
