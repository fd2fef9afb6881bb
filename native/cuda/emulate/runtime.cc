// The CUDA emulator's runtime (cuda_runtime.h says what it emulates): the block scheduler with its barriers, and the
// runtime API as host functions on one fake device.
#include "cuda_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define TPEMU_ASAN 1
#else
#define TPEMU_ASAN 0
#endif

// The hand-written switch on x86-64; ucontext elsewhere, or when built with -DTPEMU_UCONTEXT (to test that path).
#if defined(__x86_64__) && !defined(TPEMU_UCONTEXT)
#define TPEMU_FAST_SWITCH 1
#else
#define TPEMU_FAST_SWITCH 0
#include <ucontext.h>
#endif

uint3 threadIdx, blockIdx, blockDim, gridDim;

namespace tpemu {
namespace {

#if TPEMU_FAST_SWITCH
// A context switch saves only what the SysV ABI makes callee-saved (ucontext's swapcontext also saves the signal
// mask, a system call per switch: ten times slower over the millions of fibers of a large mask). `from` receives the
// suspended stack pointer; `to` is one saved by an earlier switch or prepared by Prepare below.
extern "C" void tpemu_switch(void** from, void* to);
asm(R"(
  .text
  .p2align 4
  .type tpemu_switch, @function
tpemu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tpemu_switch, .-tpemu_switch
)");
#endif

enum State { kRunnable, kAtBarrier, kAtWarp, kDone };

struct Fiber {
  char* stack = nullptr;  // from the pool while the thread runs or waits; null before it starts and after it exits
#if TPEMU_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  uint3 tid{0, 0, 0};
  unsigned linear = 0;
  State state = kRunnable;
  const char* file = nullptr;  // where it waits
  int line = 0;
  unsigned warp_calls = 0;  // warp-synchronous calls made: their parity picks the exchange buffer
  void* fake_stack = nullptr;
};

// AddressSanitizer's stacks grow by their redzones.
constexpr size_t kStackBytes = TPEMU_ASAN ? 512 << 10 : 128 << 10;
constexpr size_t kGuardBytes = 4096;

// The block in progress: one at a time in the process (RunGrid holds grid_lock), as __shared__ variables are plain
// statics.
struct Block {
  // Stacks are taken when a thread starts and returned when it exits: a block without barriers runs every thread on
  // one warm stack, and only threads that wait at the same time need a stack each.
  std::vector<char*> free_stacks;
  const char* kernel = nullptr;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  std::vector<Fiber> fibers;  // grows to the largest block seen; stacks kept for the next block
  unsigned n = 0;
  Fiber* current = nullptr;
#if TPEMU_FAST_SWITCH
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler_ctx;
#endif
  const void* scheduler_stack = nullptr;  // for AddressSanitizer's fiber switches
  size_t scheduler_stack_bytes = 0;
  std::vector<unsigned char> exchange;  // per warp: 2 buffers x 32 lanes x 16 bytes
  std::vector<unsigned> order;
  std::mt19937_64 rng;
  uint64_t seed = 0;
  bool seeded = false;
};

Block block;
std::mutex grid_lock;
thread_local cudaError_t last_error = cudaSuccess;

[[noreturn]] void Abort(const std::string& message) {
  std::fprintf(stderr, "treepack CUDA emulator: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string Where(const Fiber& f) { return std::string(f.file) + ":" + std::to_string(f.line); }

std::string BlockName() {
  return "kernel " + std::string(block.kernel) + ", block (" + std::to_string(blockIdx.x) + "," +
         std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + ")";
}

std::string ThreadName(const Fiber& f) {
  return "thread (" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) + "," + std::to_string(f.tid.z) + ")";
}

void AsanStart(void** fake_stack, const void* bottom, size_t bytes) {
#if TPEMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack, bottom, bytes);
#else
  (void)fake_stack, (void)bottom, (void)bytes;
#endif
}

void AsanFinish(void* fake_stack, const void** bottom, size_t* bytes) {
#if TPEMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, bottom, bytes);
#else
  (void)fake_stack, (void)bottom, (void)bytes;
#endif
}

// Back to the scheduler; `exiting` when the fiber will never resume (AddressSanitizer drops its fake stack).
void Suspend(bool exiting) {
  Fiber& f = *block.current;
  AsanStart(exiting ? nullptr : &f.fake_stack, block.scheduler_stack, block.scheduler_stack_bytes);
#if TPEMU_FAST_SWITCH
  tpemu_switch(&f.sp, block.scheduler_sp);
#else
  swapcontext(&f.ctx, &block.scheduler_ctx);
#endif
  AsanFinish(f.fake_stack, nullptr, nullptr);
}

[[noreturn]] void FiberMain() {
  AsanFinish(nullptr, &block.scheduler_stack, &block.scheduler_stack_bytes);
  block.body(block.ctx);
  block.current->state = kDone;
  Suspend(true);
  Abort("a finished fiber was resumed");
}

char* TakeStack() {
  if (!block.free_stacks.empty()) {
    char* stack = block.free_stacks.back();
    block.free_stacks.pop_back();
    return stack;
  }
  void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) Abort("out of memory for fiber stacks");
  mprotect(p, kGuardBytes, PROT_NONE);  // an overflowing kernel faults instead of corrupting the next stack
  return static_cast<char*>(p) + kGuardBytes;
}

// Stack tops a power of two apart would share cache sets: each stack's top is moved down by a different amount.
size_t TopOffset(const char* stack) {
  return (reinterpret_cast<uintptr_t>(stack) / (kStackBytes + kGuardBytes) % 61) * 64;
}

void Prepare(Fiber& f) {
  f.stack = TakeStack();
#if TPEMU_ASAN
  // Frames of the fiber that used this stack before never returned: their redzones would poison this one.
  ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);
#endif
#if TPEMU_FAST_SWITCH
  // What tpemu_switch pops: MXCSR and the x87 control word (their defaults), six registers, then FiberMain as the
  // return address; FiberMain starts with the stack aligned as after a call.
  auto* top = reinterpret_cast<uint64_t*>(f.stack + kStackBytes - TopOffset(f.stack));
  uint64_t* sp = top - 9;
  std::memset(sp, 0, 9 * sizeof(uint64_t));
  const uint32_t mxcsr = 0x1F80;
  const uint16_t fpucw = 0x037F;
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  sp[7] = reinterpret_cast<uint64_t>(&FiberMain);
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStackBytes - TopOffset(f.stack);
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, reinterpret_cast<void (*)()>(&FiberMain), 0);
#endif
}

void Resume(Fiber& f) {
  block.current = &f;
  threadIdx = f.tid;
  void* fake_stack = nullptr;
  AsanStart(&fake_stack, f.stack, kStackBytes);
#if TPEMU_FAST_SWITCH
  tpemu_switch(&block.scheduler_sp, f.sp);
#else
  swapcontext(&block.scheduler_ctx, &f.ctx);
#endif
  AsanFinish(fake_stack, nullptr, nullptr);
  block.current = nullptr;
  if (f.state == kDone) {
    block.free_stacks.push_back(f.stack);
    f.stack = nullptr;
  }
}

// Releases every warp whose lanes all wait at the same warp-synchronous call; whether any was released.
bool ReleaseWarps() {
  bool released = false;
  for (unsigned w = 0; w * 32 < block.n; w++) {
    const unsigned lo = w * 32, hi = std::min(block.n, lo + 32);
    bool any = false, all = true;
    for (unsigned t = lo; t < hi; t++) {
      any |= block.fibers[t].state == kAtWarp;
      all &= block.fibers[t].state == kAtWarp;
    }
    if (!any || !all) continue;
    for (unsigned t = lo + 1; t < hi; t++) {
      if (block.fibers[t].line != block.fibers[lo].line || block.fibers[t].file != block.fibers[lo].file) {
        Abort(BlockName() + ": lanes of warp " + std::to_string(w) + " wait at different warp-synchronous calls (" +
              ThreadName(block.fibers[lo]) + " at " + Where(block.fibers[lo]) + ", " + ThreadName(block.fibers[t]) +
              " at " + Where(block.fibers[t]) + ")");
      }
    }
    for (unsigned t = lo; t < hi; t++) block.fibers[t].state = kRunnable;
    released = true;
  }
  return released;
}

// Nothing can run and no warp can be released: every live thread must wait at one __syncthreads, or the block is
// stuck (on a GPU: a hang, or undefined behaviour).
void ReleaseBarrier() {
  const Fiber* waiting = nullptr;
  for (unsigned t = 0; t < block.n; t++) {
    const Fiber& f = block.fibers[t];
    if (f.state == kAtBarrier && waiting == nullptr) waiting = &f;
    if (f.state == kAtWarp) {
      for (unsigned u = t / 32 * 32; u < std::min(block.n, t / 32 * 32 + 32); u++) {
        const Fiber& g = block.fibers[u];
        if (g.state == kAtWarp) continue;
        Abort(BlockName() + ": " + ThreadName(f) + " waits at " + f.file + ":" + std::to_string(f.line) +
              " for its warp, but " + ThreadName(g) +
              (g.state == kDone ? " has exited" : " waits at __syncthreads " + Where(g)) +
              " (a divergent warp-synchronous call: on a GPU it hangs or is undefined)");
      }
    }
  }
  if (waiting == nullptr) Abort(BlockName() + ": no thread can run and none waits at a barrier (an emulator bug)");
  for (unsigned t = 0; t < block.n; t++) {
    const Fiber& f = block.fibers[t];
    if (f.state == kDone) {
      Abort(BlockName() + ": " + ThreadName(*waiting) + " waits at __syncthreads " + Where(*waiting) + " but " +
            ThreadName(f) + " exited without reaching it (a divergent barrier: on a GPU it hangs or is undefined)");
    }
    if (f.line != waiting->line || f.file != waiting->file) {
      Abort(BlockName() + ": threads wait at different __syncthreads (" + ThreadName(*waiting) + " at " +
            Where(*waiting) + ", " + ThreadName(f) + " at " + Where(f) +
            "; a divergent barrier: on a GPU it hangs or is undefined)");
    }
  }
  for (unsigned t = 0; t < block.n; t++) block.fibers[t].state = kRunnable;
}

void RunBlock() {
  block.order.resize(block.n);
  for (unsigned t = 0; t < block.n; t++) {
    Fiber& f = block.fibers[t];
    f.linear = t;
    f.tid = uint3{t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y)};
    f.state = kRunnable;
    f.warp_calls = 0;
    f.stack = nullptr;
    block.order[t] = t;
  }
  for (;;) {
    if (block.seed != 0) std::shuffle(block.order.begin(), block.order.end(), block.rng);
    for (unsigned t : block.order) {
      Fiber& f = block.fibers[t];
      if (f.state != kRunnable) continue;
      if (f.stack == nullptr) Prepare(f);
      Resume(f);
    }
    if (ReleaseWarps()) continue;
    bool done = true;
    for (unsigned t = 0; t < block.n && done; t++) done = block.fibers[t].state == kDone;
    if (done) return;
    ReleaseBarrier();
  }
}

Fiber& Self(const char* what) {
  if (block.current == nullptr) Abort(std::string(what) + " called outside a kernel");
  return *block.current;
}

}  // namespace

void SyncThreads(const char* file, int line) {
  Fiber& f = Self("__syncthreads");
  f.state = kAtBarrier;
  f.file = file;
  f.line = line;
  Suspend(false);
}

unsigned LaneId() { return Self("a warp intrinsic").linear % 32; }

const unsigned char* WarpExchange(const char* file, int line, const char* what, unsigned mask, const void* value,
                                  size_t size) {
  Fiber& f = Self(what);
  const unsigned warp = f.linear / 32, lanes = std::min(32u, block.n - warp * 32);
  const unsigned full = lanes == 32 ? ~0u : (1u << lanes) - 1u;
  if (mask != full) {
    Abort(BlockName() + ": " + what + " at " + file + ":" + std::to_string(line) + " with mask " +
          std::to_string(mask) + ": the emulator supports only the mask of the warp's " + std::to_string(lanes) +
          " lanes");
  }
  // Two buffers: a lane can be one call ahead of a lane still reading (the next call's barrier holds it there).
  unsigned char* buf = &block.exchange[(warp * 2 + f.warp_calls % 2) * 32 * 16];
  f.warp_calls++;
  std::memcpy(buf + (f.linear % 32) * 16, value, size);
  f.state = kAtWarp;
  f.file = file;
  f.line = line;
  Suspend(false);
  return buf;
}

void RunGrid(const char* kernel, dim3 grid, dim3 block_dim, size_t shared_bytes, cudaStream_t, void (*body)(void*),
             void* ctx) {
  const uint64_t threads = uint64_t(block_dim.x) * block_dim.y * block_dim.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      threads == 0 || threads > 1024 || block_dim.z > 64) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (shared_bytes != 0) Abort(std::string("kernel ") + kernel + ": dynamic shared memory is not emulated");
  std::lock_guard<std::mutex> one_grid_at_a_time(grid_lock);
  if (!block.seeded) {
    const char* s = std::getenv("TREEPACK_CUDA_EMULATE_SEED");
    block.seed = s != nullptr && *s != '\0' ? std::strtoull(s, nullptr, 10) : 1;
    block.rng.seed(block.seed);
    block.seeded = true;
  }
  block.kernel = kernel;
  block.body = body;
  block.ctx = ctx;
  block.n = static_cast<unsigned>(threads);
  if (block.fibers.size() < block.n) block.fibers.resize(block.n);
  block.exchange.assign((block.n + 31) / 32 * 2 * 32 * 16, 0);
  gridDim = uint3{grid.x, grid.y, grid.z};
  blockDim = uint3{block_dim.x, block_dim.y, block_dim.z};
  for (unsigned z = 0; z < grid.z; z++) {
    for (unsigned y = 0; y < grid.y; y++) {
      for (unsigned x = 0; x < grid.x; x++) {
        blockIdx = uint3{x, y, z};
        RunBlock();
      }
    }
  }
}

}  // namespace tpemu

// The runtime API on one fake device: device memory is host memory, every stream is the caller's thread, so every
// call completes before it returns.
namespace {

struct EventTime {
  std::chrono::steady_clock::time_point at;
};

cudaError_t Set(cudaError_t err) {
  if (err != cudaSuccess) tpemu::last_error = err;
  return err;
}

}  // namespace

struct CUevent_st : EventTime {};

cudaError_t cudaGetLastError() {
  const cudaError_t err = tpemu::last_error;
  tpemu::last_error = cudaSuccess;
  return err;
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
  }
  return "unrecognized error code";
}

// No CUDA runtime or driver: versions 0.
cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return Set(cudaErrorInvalidValue);
  *version = 0;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) { return cudaRuntimeGetVersion(version); }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Set(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return Set(cudaErrorInvalidValue);
  if (device != 0) return Set(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof *prop);
  // The name is what `treepack doctor` and the backend report show: nobody must take this for a GPU.
  std::snprintf(prop->name, sizeof prop->name, "treepack CUDA emulator (emulated on the CPU, not a GPU)");
  prop->major = 0;  // no compute capability: sm_00
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->totalGlobalMem = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return Set(cudaErrorInvalidValue);
  *ptr = std::malloc(bytes > 0 ? bytes : 1);
  return *ptr == nullptr ? Set(cudaErrorMemoryAllocation) : cudaSuccess;
}

cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t) { return cudaMalloc(ptr, bytes); }

cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) { return cudaFree(ptr); }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return Set(cudaErrorInvalidValue);
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return Set(cudaErrorInvalidValue);
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  if (bytes > 0 && ptr == nullptr) return Set(cudaErrorInvalidValue);
  if (bytes > 0) std::memset(ptr, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  if (event == nullptr) return Set(cudaErrorInvalidValue);
  *event = new CUevent_st();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return Set(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}

// Events time the host clock: the emulated kernels ran before the call returned.
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  if (event == nullptr) return Set(cudaErrorInvalidResourceHandle);
  event->at = std::chrono::steady_clock::now();
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event == nullptr ? Set(cudaErrorInvalidResourceHandle) : cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop) {
  if (ms == nullptr) return Set(cudaErrorInvalidValue);
  if (start == nullptr || stop == nullptr) return Set(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(stop->at - start->at).count();
  return cudaSuccess;
}
