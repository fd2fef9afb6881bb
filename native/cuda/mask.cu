// Mask lowerings on the GPU (native/cuda/treepack_cuda.h); the reference is src/mask, the CPU twin
// native/core/mask.cc, and both take the attention rule and the block rule from native/core/mask_math.h. Every
// kernel writes its whole output, padding included, so outputs need no zeroing (the CPU core does the same).
#include <cuda_runtime.h>

#include "../core/mask_math.h"
#include "status.h"
#include "treepack_cuda.h"

namespace tmask = treepack::mask;
using treepack::cuda::Fail;
using treepack::cuda::Status;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = 65535;

unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// One thread per output byte; grid-stride.
__global__ void DenseKernel(const int32_t* __restrict__ se, int64_t n, uint8_t* __restrict__ out) {
  const int64_t total = n * n, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    out[i] = tmask::Visible(se, i / n, i % n) ? 1 : 0;
  }
}

// One thread per uint32 word (q, w): bits k = 32w .. 32w + 31.
__global__ void BitsKernel(const int32_t* __restrict__ se, int64_t n, int64_t width, uint32_t* __restrict__ out) {
  const int64_t total = n * width, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += stride) {
    const int64_t q = w / width, k0 = (w % width) * 32;
    uint32_t word = 0;
    for (int b = 0; b < 32 && k0 + b < n; b++) word |= (tmask::Visible(se, q, k0 + b) ? 1u : 0u) << b;
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
      const tmask::BlockEnds e = tmask::BlockEndsOf(lo, hi, B, nb);
      ends[2 * j] = static_cast<int32_t>(e.full_end);
      ends[2 * j + 1] = static_cast<int32_t>(e.any_end);
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
        is_full = tmask::DiagonalFull(B);
        is_part = !is_full;
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
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  cudaError_t alloc(int64_t bytes) { return cudaMalloc(&ptr, static_cast<size_t>(bytes > 0 ? bytes : 4)); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

// Copies parent and subtree_end in, runs `launch` between two events, and reports the kernels' time in ms.
template <typename Launch>
int RunTimed(const int32_t* parent, const int32_t* subtree_end, int64_t n, DeviceBuffer* d_tree, float* kernel_ms,
             Launch launch) {
  cudaError_t err;
  const size_t bytes = 4 * static_cast<size_t>(n);
  if ((err = d_tree->alloc(8 * n)) != cudaSuccess) return Fail(err);
  if (n > 0 &&
      ((parent != nullptr && (err = cudaMemcpy(d_tree->ptr, parent, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) ||
       (err = cudaMemcpy(d_tree->as<int32_t>() + n, subtree_end, bytes, cudaMemcpyHostToDevice)) != cudaSuccess)) {
    return Fail(err);
  }
  Events ev;
  if ((err = cudaEventCreate(&ev.start)) != cudaSuccess || (err = cudaEventCreate(&ev.stop)) != cudaSuccess) {
    return Fail(err);
  }
  cudaEventRecord(ev.start);
  const int rc = launch(d_tree->as<int32_t>(), d_tree->as<int32_t>() + n);
  if (rc != TP_OK) return rc;
  cudaEventRecord(ev.stop);
  if ((err = cudaEventSynchronize(ev.stop)) != cudaSuccess) return Fail(err);
  float ms = 0;
  cudaEventElapsedTime(&ms, ev.start, ev.stop);
  if (kernel_ms != nullptr) *kernel_ms = ms;
  return TP_OK;
}

// The argument checks of the device-pointer entry points: what they can check without reading device memory.
int CheckDeviceTree(const int32_t* parent, const int32_t* subtree_end, int64_t n) {
  if (n < 0 || (n > 0 && (parent == nullptr || subtree_end == nullptr))) return TP_ERR_ARG;
  return n > INT32_MAX ? TP_ERR_TOO_LARGE : TP_OK;
}

}  // namespace

extern "C" {

int tp_cuda_mask_dense(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint8_t* out, void* stream) {
  int rc = CheckDeviceTree(parent, subtree_end, n);
  if (rc != TP_OK) return rc;
  if (n == 0) return TP_OK;
  if (out == nullptr) return TP_ERR_ARG;
  DenseKernel<<<GridFor(n * n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(subtree_end, n, out);
  return Status(cudaGetLastError());
}

int tp_cuda_mask_bits(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint32_t* out, void* stream) {
  int rc = CheckDeviceTree(parent, subtree_end, n);
  if (rc != TP_OK) return rc;
  if (n == 0) return TP_OK;
  if (out == nullptr) return TP_ERR_ARG;
  const int64_t width = (n + 31) / 32;
  BitsKernel<<<GridFor(n * width), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(subtree_end, n, width, out);
  return Status(cudaGetLastError());
}

int tp_cuda_mask_blocks(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num, int32_t* kv_idx,
                        int32_t* full_num, int32_t* full_idx, void* stream) {
  if (n < 0 || (n > 0 && subtree_end == nullptr) || block_size < 1) return TP_ERR_ARG;
  if (n > INT32_MAX) return TP_ERR_TOO_LARGE;
  const int64_t B = block_size, nb = (n + B - 1) / B;
  if (nb == 0) return TP_OK;
  if (kv_num == nullptr || kv_idx == nullptr || full_num == nullptr || full_idx == nullptr) return TP_ERR_ARG;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The per-block ends live only between the two kernels: stream-ordered scratch, freed in stream order.
  int32_t* ends = nullptr;
  cudaError_t err = cudaMallocAsync(&ends, sizeof(int32_t) * 2 * static_cast<size_t>(nb), s);
  if (err != cudaSuccess) return Fail(err);
  BlockEndsKernel<<<GridFor(32 * nb), kThreads, 0, s>>>(subtree_end, n, B, nb, ends);
  BlockRowsKernel<<<static_cast<unsigned>(nb < kMaxBlocks ? nb : kMaxBlocks), kThreads, 0, s>>>(
      ends, B, nb, kv_num, kv_idx, full_num, full_idx);
  err = cudaGetLastError();
  cudaFreeAsync(ends, s);
  return Status(err);
}

int tp_cuda_mask_dense_host(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint8_t* out,
                            float* kernel_ms) {
  int rc = tmask::CheckTree(parent, subtree_end, n, true, true);
  if (rc != TP_OK) return rc;
  if (n > 0 && out == nullptr) return TP_ERR_ARG;
  DeviceBuffer d_tree, d_out;
  cudaError_t err;
  if ((err = d_out.alloc(n * n)) != cudaSuccess) return Fail(err);
  rc = RunTimed(parent, subtree_end, n, &d_tree, kernel_ms, [&](const int32_t* p, const int32_t* se) {
    return tp_cuda_mask_dense(p, se, n, d_out.as<uint8_t>(), nullptr);
  });
  if (rc != TP_OK) return rc;
  if (n > 0 && (err = cudaMemcpy(out, d_out.ptr, static_cast<size_t>(n * n), cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return Fail(err);
  }
  return TP_OK;
}

int tp_cuda_mask_bits_host(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint32_t* out,
                           float* kernel_ms) {
  int rc = tmask::CheckTree(parent, subtree_end, n, true, true);
  if (rc != TP_OK) return rc;
  if (n > 0 && out == nullptr) return TP_ERR_ARG;
  const int64_t bytes = 4 * n * ((n + 31) / 32);
  DeviceBuffer d_tree, d_out;
  cudaError_t err;
  if ((err = d_out.alloc(bytes)) != cudaSuccess) return Fail(err);
  rc = RunTimed(parent, subtree_end, n, &d_tree, kernel_ms, [&](const int32_t* p, const int32_t* se) {
    return tp_cuda_mask_bits(p, se, n, d_out.as<uint32_t>(), nullptr);
  });
  if (rc != TP_OK) return rc;
  if (bytes > 0 &&
      (err = cudaMemcpy(out, d_out.ptr, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return Fail(err);
  }
  return TP_OK;
}

int tp_cuda_mask_blocks_host(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num,
                             int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, float* kernel_ms) {
  int rc = tmask::CheckTree(nullptr, subtree_end, n, false, true);
  if (rc != TP_OK) return rc;
  if (block_size < 1) return TP_ERR_ARG;
  const int64_t nb = (n + block_size - 1) / block_size;
  if (nb > 0 && (kv_num == nullptr || kv_idx == nullptr || full_num == nullptr || full_idx == nullptr))
    return TP_ERR_ARG;
  DeviceBuffer d_tree, d_num, d_kv, d_full;
  cudaError_t err;
  if ((err = d_num.alloc(8 * nb)) != cudaSuccess || (err = d_kv.alloc(4 * nb * nb)) != cudaSuccess ||
      (err = d_full.alloc(4 * nb * nb)) != cudaSuccess) {
    return Fail(err);
  }
  int32_t* num = d_num.as<int32_t>();
  rc = RunTimed(nullptr, subtree_end, n, &d_tree, kernel_ms, [&](const int32_t*, const int32_t* se) {
    return tp_cuda_mask_blocks(se, n, block_size, num, d_kv.as<int32_t>(), num + nb, d_full.as<int32_t>(), nullptr);
  });
  if (rc != TP_OK || nb == 0) return rc;
  const size_t row = 4 * static_cast<size_t>(nb), all = row * static_cast<size_t>(nb);
  if ((err = cudaMemcpy(kv_num, num, row, cudaMemcpyDeviceToHost)) != cudaSuccess ||
      (err = cudaMemcpy(full_num, num + nb, row, cudaMemcpyDeviceToHost)) != cudaSuccess ||
      (err = cudaMemcpy(kv_idx, d_kv.ptr, all, cudaMemcpyDeviceToHost)) != cudaSuccess ||
      (err = cudaMemcpy(full_idx, d_full.ptr, all, cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return Fail(err);
  }
  return TP_OK;
}

}  // extern "C"
