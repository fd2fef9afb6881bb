// The unmerge gather: per-occurrence values from per-node ones (input_ids[seq_positions], node logprobs).
#include <cuda_runtime.h>

#include "status.h"
#include "treepack_cuda.h"

using treepack::cuda::Fail;
using treepack::cuda::Status;

namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H100/H200 several times over; the grid-stride loop covers any larger n.
constexpr int64_t kMaxBlocks = 65535;

__global__ void gather_i32(const int32_t* __restrict__ src, int64_t src_n, const int32_t* __restrict__ idx, int64_t n,
                           int32_t* __restrict__ dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int32_t j = idx[i];
    // A bad index must not fault: an illegal address would poison the caller's whole CUDA context.
    dst[i] = j >= 0 && j < src_n ? src[j] : 0;
  }
}

// Frees on every exit path of the host wrapper.
struct DeviceBuffer {
  int32_t* ptr = nullptr;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  cudaError_t alloc(int64_t n) { return cudaMalloc(&ptr, sizeof(int32_t) * static_cast<size_t>(n > 0 ? n : 1)); }
};

}  // namespace

extern "C" {

int tp_cuda_gather_i32(const int32_t* src, int64_t src_n, const int32_t* idx, int64_t n, int32_t* dst, void* stream) {
  if (n < 0 || src_n < 0) return TP_ERR_ARG;
  if (n == 0) return TP_OK;
  if (src == nullptr || idx == nullptr || dst == nullptr) return TP_ERR_ARG;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  gather_i32<<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0,
               static_cast<cudaStream_t>(stream)>>>(src, src_n, idx, n, dst);
  return Status(cudaGetLastError());
}

int tp_cuda_gather_i32_host(const int32_t* src, int64_t src_n, const int32_t* idx, int64_t n, int32_t* dst) {
  if (n < 0 || src_n < 0 || (src == nullptr && src_n > 0) || ((idx == nullptr || dst == nullptr) && n > 0)) {
    return TP_ERR_ARG;
  }
  // Touch the runtime even for n == 0, so that a missing driver is reported the same way for every input.
  DeviceBuffer d_src, d_idx, d_dst;
  cudaError_t err;
  if ((err = d_src.alloc(src_n)) != cudaSuccess || (err = d_idx.alloc(n)) != cudaSuccess ||
      (err = d_dst.alloc(n)) != cudaSuccess) {
    return Fail(err);
  }
  const size_t src_bytes = sizeof(int32_t) * static_cast<size_t>(src_n),
               bytes = sizeof(int32_t) * static_cast<size_t>(n);
  if ((src_bytes > 0 && (err = cudaMemcpy(d_src.ptr, src, src_bytes, cudaMemcpyHostToDevice)) != cudaSuccess) ||
      (bytes > 0 && (err = cudaMemcpy(d_idx.ptr, idx, bytes, cudaMemcpyHostToDevice)) != cudaSuccess)) {
    return Fail(err);
  }
  const int rc = tp_cuda_gather_i32(d_src.ptr, src_n, d_idx.ptr, n, d_dst.ptr, nullptr);
  if (rc != TP_OK) return rc;
  if (bytes > 0 && (err = cudaMemcpy(dst, d_dst.ptr, bytes, cudaMemcpyDeviceToHost)) != cudaSuccess) return Fail(err);
  return TP_OK;
}

}  // extern "C"
