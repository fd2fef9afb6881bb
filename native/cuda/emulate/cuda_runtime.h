// The CUDA emulator: native/cuda's kernels compiled by g++ and executed on the CPU, for CI hosts without a GPU.
// Found as <cuda_runtime.h> by the emulated build only (CMake option TREEPACK_CUDA_EMULATE, CONTRIBUTING.md), which
// also rewrites every launch `k<<<grid, block, shmem, stream>>>(args)` into `TPEMU_LAUNCH(k, grid, ...)(args)`.
//
// Each block runs as cooperative fibers on the calling OS thread, one per CUDA thread (runtime.cc): __syncthreads
// waits until every thread of the block arrives, warp shuffles and ballots until every lane of the warp does, and a
// barrier that some thread never reaches aborts with a message naming the kernel and the line (a GPU would hang or
// be undefined there). TREEPACK_CUDA_EMULATE_SEED (default 1; 0 runs threads in index order) shuffles the order in
// which ready fibers run. One block runs at a time in the process, so __shared__ variables are plain statics (they
// keep the previous block's values where a GPU's are undefined).
// Only what native/cuda uses is provided; anything else fails to compile, on purpose, until someone adds it.
#ifndef TREEPACK_CUDA_EMULATE_RUNTIME_H
#define TREEPACK_CUDA_EMULATE_RUNTIME_H

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __syncthreads() ::tpemu::SyncThreads(__FILE__, __LINE__)
#define __shfl_down_sync(...) ::tpemu::ShflDown(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, pred) ::tpemu::Ballot(__FILE__, __LINE__, mask, pred)
#define TPEMU_LAUNCH(kernel, ...) ::tpemu::MakeLauncher(#kernel, kernel, __VA_ARGS__)

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int major, minor, multiProcessorCount;
};

// Set by the scheduler before it resumes a fiber (plain globals: the hot path of every kernel reads them).
extern uint3 threadIdx, blockIdx, blockDim, gridDim;

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop);

// cuda_runtime.h's typed overloads.
template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
template <typename T>
cudaError_t cudaMallocAsync(T** ptr, size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(ptr), bytes, stream);
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }

// Fibers of one OS thread never run at once, but callers on several OS threads may launch at the same time.
template <typename T>
T atomicOr(T* address, T value) {
  static_assert(std::is_integral<T>::value, "atomicOr: integers only");
  return __atomic_fetch_or(address, value, __ATOMIC_RELAXED);
}

// The device overloads of min and max (CUDA's math API).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline double min(double a, double b) { return a < b ? a : b; }
inline double max(double a, double b) { return a > b ? a : b; }

namespace tpemu {

void SyncThreads(const char* file, int line);
// Every lane of the calling warp deposits `size` (<= 16) bytes at `value` and waits for the others; returns the
// deposits, lane l's at 16 * l, valid until the caller's next warp-synchronous call. `mask` must name exactly the
// warp's lanes (what native/cuda does; partial masks are refused).
const unsigned char* WarpExchange(const char* file, int line, const char* what, unsigned mask, const void* value,
                                  size_t size);
unsigned LaneId();

template <typename T>
T ShflDown(const char* file, int line, unsigned mask, T var, unsigned delta, int width = 32) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 16, "__shfl_down_sync: up to 16 trivial bytes");
  const unsigned char* all = WarpExchange(file, line, "__shfl_down_sync", mask, &var, sizeof(T));
  const unsigned lane = LaneId(), src = lane + delta;
  // Out of the lane's width-segment, the lane keeps its own value (CUDA's rule).
  if (src < (lane / width + 1) * static_cast<unsigned>(width)) std::memcpy(&var, all + 16 * src, sizeof(T));
  return var;
}

inline unsigned Ballot(const char* file, int line, unsigned mask, bool pred) {
  const unsigned char* all = WarpExchange(file, line, "__ballot_sync", mask, &pred, sizeof pred);
  unsigned bits = 0;
  for (unsigned lane = 0; lane < 32; lane++) bits |= (mask >> lane & 1u) && all[16 * lane] ? 1u << lane : 0u;
  return bits;
}

// Runs `body(ctx)` once per thread of every block, block after block; sets cudaGetLastError on a bad configuration.
void RunGrid(const char* kernel, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, void (*body)(void*),
             void* ctx);

template <typename... P>
struct Launcher {
  const char* name;
  void (*kernel)(P...);
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;

  template <typename... A>
  void operator()(A&&... a) const {
    // The parameters are copied once, as a launch copies them to the device; each thread gets its own copy.
    struct Call {
      void (*kernel)(P...);
      std::tuple<std::decay_t<P>...> args;
    } call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(a)...)};
    RunGrid(
        name, grid, block, shared_bytes, stream,
        [](void* c) {
          Call* k = static_cast<Call*>(c);
          std::apply(k->kernel, k->args);
        },
        &call);
  }
};

template <typename... P>
Launcher<P...> MakeLauncher(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes = 0,
                            cudaStream_t stream = nullptr) {
  return Launcher<P...>{name, kernel, grid, block, shared_bytes, stream};
}

}  // namespace tpemu

#endif  // TREEPACK_CUDA_EMULATE_RUNTIME_H
