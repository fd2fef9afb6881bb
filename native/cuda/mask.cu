// Mask lowerings on the GPU (native/cuda/treepack_cuda.h); the reference is src/mask, the CPU twin
// native/core/mask.cc. Every kernel writes its whole output, padding included, so outputs need no zeroing.
#include <cuda_runtime.h>

#include "treepack_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = 65535;

unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__device__ __forceinline__ bool Visible(const int32_t* se, int64_t q, int64_t k) { return k <= q && q < se[k]; }

// One thread per output byte; grid-stride.
__global__ void DenseKernel(const int32_t* __restrict__ se, int64_t n, uint8_t* __restrict__ out) {
  const int64_t total = n * n, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    out[i] = Visible(se, i / n, i % n) ? 1 : 0;
  }
}

// One thread per uint32 word (q, w): bits k = 32w .. 32w + 31.
__global__ void BitsKernel(const int32_t* __restrict__ se, int64_t n, int64_t width, uint32_t* __restrict__ out) {
  const int64_t total = n * width, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += stride) {
    const int64_t q = w / width, k0 = (w % width) * 32;
    uint32_t word = 0;
    for (int b = 0; b < 32 && k0 + b < n; b++) word |= (Visible(se, q, k0 + b) ? 1u : 0u) << b;
    out[w] = word;
  }
}

// One warp per kv block j: ends[2j] = floor(lo_j / B) (full below), ends[2j + 1] = min(nb, ceil(hi_j / B)).
__global__ void BlockEndsKernel(const int32_t* __restrict__ se, int64_t n, int64_t B, int64_t nb,
                                int32_t* __restrict__ ends) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t j = warp; j < nb; j += warps) {
    int32_t lo = INT32_MAX, hi = 0;
    const int64_t end = (j + 1) * B < n ? (j + 1) * B : n;
    for (int64_t k = j * B + lane; k < end; k += 32) {
      lo = min(lo, se[k]);
      hi = max(hi, se[k]);
    }
    for (int off = 16; off > 0; off >>= 1) {
      lo = min(lo, __shfl_down_sync(0xffffffffu, lo, off));
      hi = max(hi, __shfl_down_sync(0xffffffffu, hi, off));
    }
    if (lane == 0) {
      ends[2 * j] = static_cast<int32_t>(lo / B);
      const int64_t any = (hi + B - 1) / B;
      ends[2 * j + 1] = static_cast<int32_t>(any < nb ? any : nb);
    }
  }
}

// One CTA per query block row i: the kv blocks j <= i are classified a chunk of kThreads at a time and compacted
// in order (warp ballots, then a prefix over the warps), then the rest of both rows is zeroed.
__global__ void BlockRowsKernel(const int32_t* __restrict__ ends, int64_t B, int64_t nb, int32_t* __restrict__ kv_num,
                                int32_t* __restrict__ kv_idx, int32_t* __restrict__ full_num,
                                int32_t* __restrict__ full_idx) {
  __shared__ int32_t warp_part[kWarps], warp_full[kWarps];
  __shared__ int32_t base_part, base_full;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t i = blockIdx.x; i < nb; i += gridDim.x) {
    if (threadIdx.x == 0) base_part = base_full = 0;
    __syncthreads();
    int32_t* part = kv_idx + i * nb;
    int32_t* full = full_idx + i * nb;
    for (int64_t j0 = 0; j0 <= i; j0 += kThreads) {
      const int64_t j = j0 + threadIdx.x;
      bool is_full = false, is_part = false;
      if (j < i) {
        is_full = i < ends[2 * j];
        is_part = !is_full && i < ends[2 * j + 1];
      } else if (j == i) {
        is_full = B == 1;
        is_part = B != 1;
      }
      const unsigned bp = __ballot_sync(0xffffffffu, is_part), bf = __ballot_sync(0xffffffffu, is_full);
      if (lane == 0) {
        warp_part[warp] = __popc(bp);
        warp_full[warp] = __popc(bf);
      }
      __syncthreads();
      int32_t off_part = base_part, off_full = base_full;
      for (int w = 0; w < warp; w++) {
        off_part += warp_part[w];
        off_full += warp_full[w];
      }
      const unsigned below = (1u << lane) - 1u;
      if (is_part) part[off_part + __popc(bp & below)] = static_cast<int32_t>(j);
      if (is_full) full[off_full + __popc(bf & below)] = static_cast<int32_t>(j);
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int w = 0; w < kWarps; w++) {
          base_part += warp_part[w];
          base_full += warp_full[w];
        }
      }
      __syncthreads();
    }
    const int32_t np = base_part, nf = base_full;
    for (int64_t t = threadIdx.x; t < nb; t += kThreads) {
      if (t >= np) part[t] = 0;
      if (t >= nf) full[t] = 0;
    }
    if (threadIdx.x == 0) {
      kv_num[i] = np;
      full_num[i] = nf;
    }
    __syncthreads();
  }
}

struct DeviceBuffer {
  void* ptr = nullptr;
  ~DeviceBuffer() { cudaFree(ptr); }
  cudaError_t alloc(int64_t bytes) { return cudaMalloc(&ptr, static_cast<size_t>(bytes > 0 ? bytes : 4)); }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

// Copies subtree_end in, runs `launch` between two events, and reports the kernels' time in ms.
template <typename Launch>
int RunTimed(const int32_t* subtree_end, int64_t n, DeviceBuffer* d_se, float* kernel_ms, Launch launch) {
  cudaError_t err;
  if ((err = d_se->alloc(4 * n)) != cudaSuccess) return err;
  if (n > 0 && (err = cudaMemcpy(d_se->ptr, subtree_end, 4 * static_cast<size_t>(n), cudaMemcpyHostToDevice)) !=
                   cudaSuccess) {
    return err;
  }
  Events ev;
  if ((err = cudaEventCreate(&ev.start)) != cudaSuccess || (err = cudaEventCreate(&ev.stop)) != cudaSuccess) return err;
  cudaEventRecord(ev.start);
  if ((err = static_cast<cudaError_t>(launch())) != cudaSuccess) return err;
  cudaEventRecord(ev.stop);
  if ((err = cudaEventSynchronize(ev.stop)) != cudaSuccess) return err;
  float ms = 0;
  cudaEventElapsedTime(&ms, ev.start, ev.stop);
  if (kernel_ms != nullptr) *kernel_ms = ms;
  return cudaSuccess;
}

}  // namespace

extern "C" {

int tp_cuda_mask_dense(const int32_t* subtree_end, int64_t n, uint8_t* out, void* stream) {
  if (n < 0 || (n > 0 && (subtree_end == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  DenseKernel<<<GridFor(n * n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(subtree_end, n, out);
  return cudaGetLastError();
}

int tp_cuda_mask_bits(const int32_t* subtree_end, int64_t n, uint32_t* out, void* stream) {
  if (n < 0 || (n > 0 && (subtree_end == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t width = (n + 31) / 32;
  BitsKernel<<<GridFor(n * width), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(subtree_end, n, width, out);
  return cudaGetLastError();
}

int tp_cuda_mask_blocks(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* workspace,
                        int32_t* kv_num, int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, void* stream) {
  if (n < 0 || block_size < 1) return cudaErrorInvalidValue;
  const int64_t B = block_size, nb = (n + B - 1) / B;
  if (nb == 0) return cudaSuccess;
  if (subtree_end == nullptr || workspace == nullptr || kv_num == nullptr || kv_idx == nullptr ||
      full_num == nullptr || full_idx == nullptr) {
    return cudaErrorInvalidValue;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  BlockEndsKernel<<<GridFor(32 * nb), kThreads, 0, s>>>(subtree_end, n, B, nb, workspace);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  BlockRowsKernel<<<static_cast<unsigned>(nb < kMaxBlocks ? nb : kMaxBlocks), kThreads, 0, s>>>(
      workspace, B, nb, kv_num, kv_idx, full_num, full_idx);
  return cudaGetLastError();
}

int tp_cuda_mask_dense_host(const int32_t* subtree_end, int64_t n, uint8_t* out, float* kernel_ms) {
  if (n < 0 || (n > 0 && (subtree_end == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  DeviceBuffer d_se, d_out;
  cudaError_t err;
  if ((err = d_out.alloc(n * n)) != cudaSuccess) return err;
  int rc = RunTimed(subtree_end, n, &d_se, kernel_ms, [&] { return tp_cuda_mask_dense(d_se.as<int32_t>(), n, d_out.as<uint8_t>(), nullptr); });
  if (rc != cudaSuccess) return rc;
  return n > 0 ? cudaMemcpy(out, d_out.ptr, static_cast<size_t>(n * n), cudaMemcpyDeviceToHost) : cudaSuccess;
}

int tp_cuda_mask_bits_host(const int32_t* subtree_end, int64_t n, uint32_t* out, float* kernel_ms) {
  if (n < 0 || (n > 0 && (subtree_end == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  const int64_t bytes = 4 * n * ((n + 31) / 32);
  DeviceBuffer d_se, d_out;
  cudaError_t err;
  if ((err = d_out.alloc(bytes)) != cudaSuccess) return err;
  int rc = RunTimed(subtree_end, n, &d_se, kernel_ms, [&] { return tp_cuda_mask_bits(d_se.as<int32_t>(), n, d_out.as<uint32_t>(), nullptr); });
  if (rc != cudaSuccess) return rc;
  return bytes > 0 ? cudaMemcpy(out, d_out.ptr, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost) : cudaSuccess;
}

int tp_cuda_mask_blocks_host(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num,
                             int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, float* kernel_ms) {
  if (n < 0 || block_size < 1) return cudaErrorInvalidValue;
  const int64_t nb = (n + block_size - 1) / block_size;
  DeviceBuffer d_se, d_ws, d_num, d_kv, d_full;
  cudaError_t err;
  if ((err = d_ws.alloc(8 * nb)) != cudaSuccess || (err = d_num.alloc(8 * nb)) != cudaSuccess ||
      (err = d_kv.alloc(4 * nb * nb)) != cudaSuccess || (err = d_full.alloc(4 * nb * nb)) != cudaSuccess) {
    return err;
  }
  int32_t* num = d_num.as<int32_t>();
  int rc = RunTimed(subtree_end, n, &d_se, kernel_ms, [&] {
    return tp_cuda_mask_blocks(d_se.as<int32_t>(), n, block_size, d_ws.as<int32_t>(), num, d_kv.as<int32_t>(),
                               num + nb, d_full.as<int32_t>(), nullptr);
  });
  if (rc != cudaSuccess || nb == 0) return rc;
  const size_t row = 4 * static_cast<size_t>(nb), all = row * static_cast<size_t>(nb);
  if ((err = cudaMemcpy(kv_num, num, row, cudaMemcpyDeviceToHost)) != cudaSuccess ||
      (err = cudaMemcpy(full_num, num + nb, row, cudaMemcpyDeviceToHost)) != cudaSuccess ||
      (err = cudaMemcpy(kv_idx, d_kv.ptr, all, cudaMemcpyDeviceToHost)) != cudaSuccess ||
      (err = cudaMemcpy(full_idx, d_full.ptr, all, cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return err;
  }
  return cudaSuccess;
}

}  // extern "C"
