// The RL loss on the GPU, deterministic: no float atomics anywhere, every sum in a fixed order, so results are
// bit-identical run to run. The gradient is a segmented reduction keyed by the unmerge index: occurrences are
// stably sorted by node (CUB radix sort), and each node sums its occurrences' contributions in that order.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_runtime.h>

#include "../core/loss_math.h"
#include "status.h"
#include "treepack_cuda.h"

namespace tl = treepack::loss;
using treepack::cuda::Fail;
using treepack::cuda::Status;

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

unsigned BlocksFor(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b < kMaxBlocks ? b : kMaxBlocks);
}

// Fixed-shape tree reduction of one Sums per thread; thread 0 returns the block's total.
__device__ tl::Sums BlockReduce(tl::Sums s) {
  __shared__ tl::Sums sh[kThreads];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) sh[threadIdx.x].Merge(sh[threadIdx.x + w]);
    __syncthreads();
  }
  tl::Sums out = sh[0];
  __syncthreads();
  return out;
}

struct SeqStats {
  double n, log_ratio, log_tis, turns;  // turns: those with a trainable token (the turn mode only)
};

// Bits of the device-side input check, read back with the metrics; offsets win over positions over turn ids, as in
// tp_loss.
constexpr int32_t kBadOffsets = 1, kBadIndex = 2, kBadTurns = 4;

// What tp_loss checks on the host, checked here on the device (the arrays live there): offsets from 0 to M and
// non-decreasing, every position in [0, N). Integer atomics only. The kernels after it read every index guarded,
// so bad input never reads or writes out of bounds (which would poison a CUDA context shared with torch).
__global__ void CheckInputs(int64_t S, const int32_t* off, int64_t M, const int32_t* pos, int64_t N, int32_t* flags) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i <= S || i < M; i += stride) {
    if (i <= S) {
      const bool bad = off[i] < 0 || off[i] > M || (i == 0 && off[0] != 0) || (i == S && off[S] != M) ||
                       (i < S && off[i + 1] < off[i]);
      if (bad) atomicOr(flags, kBadOffsets);
    }
    if (i < M && (pos[i] < 0 || pos[i] >= N)) atomicOr(flags, kBadIndex);
  }
}

// Sequence i's occurrences [a, e), clipped into [0, M] so that bad offsets stay in bounds (CheckInputs reports them).
__device__ void SequenceRange(const int32_t* off, int64_t i, int64_t M, int64_t* a, int64_t* e) {
  const int64_t x = off[i], y = off[i + 1];
  *a = x < 0 ? 0 : x > M ? M : x;
  *e = y < *a ? *a : y > M ? M : y;
}

// The turn mode's occurrence counts: trainable[j] = mask[j] != 0 for j < M, 0 at M, so that its exclusive scan
// `before` [M+1] counts the trainable occurrences in any range [x, y) as before[y] − before[x].
__global__ void Trainable(const uint8_t* mask, int64_t M, int32_t* trainable) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j <= M;
       j += gridDim.x * static_cast<int64_t>(blockDim.x))
    trainable[j] = j < M && mask[j] != 0;
}

// First k in [a, e) with turn[k] > id (upper) or >= id (lower); in [a, e] even when turn is not sorted.
__device__ int64_t TurnBound(const int32_t* turn, int64_t a, int64_t e, int32_t id, bool upper) {
  while (a < e) {
    const int64_t m = a + (e - a) / 2;
    if (upper ? turn[m] <= id : turn[m] < id)
      a = m + 1;
    else
      e = m;
  }
  return a;
}

// One block per sequence: trainable count, GSPO's summed log ratio, the sequence-level TIS log weight; in the turn
// mode also the order check of turn ids, each trainable occurrence's turn size (turn_n) and the turns with any.
__global__ void SequenceStats(tp_loss_config c, int64_t S, const int32_t* off, int64_t M, const int32_t* pos, int64_t N,
                              const uint8_t* mask, const float* old, const float* roll, const float* lp,
                              const int32_t* turn, const int32_t* before, int32_t* turn_n, int32_t* flags,
                              SeqStats* out) {
  const bool turns = c.aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN;
  for (int64_t i = blockIdx.x; i < S; i += gridDim.x) {
    tl::Sums s;  // n, log_ratio, ratio and high fields carry the four sums
    int64_t a, e;
    SequenceRange(off, i, M, &a, &e);
    for (int64_t j = a + threadIdx.x; j < e; j += blockDim.x) {
      if (turns && j > a && turn[j] < turn[j - 1]) atomicOr(flags, kBadTurns);
      if (!mask[j] || pos[j] < 0 || pos[j] >= N) continue;
      s.n += 1;
      if (c.policy == TP_POLICY_GSPO) s.log_ratio += static_cast<double>(lp[pos[j]]) - old[j];
      if (c.tis == TP_TIS_SEQUENCE) s.ratio += static_cast<double>(old[j]) - roll[j];
      if (turns) {
        // The run of equal ids holding j; j opens its turn when no trainable occurrence of the run precedes it.
        const int64_t lo = TurnBound(turn, a, e, turn[j], false), hi = TurnBound(turn, a, e, turn[j], true);
        turn_n[j] = before[hi] - before[lo];
        s.high += before[j] == before[lo];
      }
    }
    s = BlockReduce(s);
    if (threadIdx.x == 0) out[i] = SeqStats{s.n, s.log_ratio, s.ratio, s.high};
  }
}

// Single block: T and G, from the per-sequence counts in a fixed order.
__global__ void Normalisers(tp_loss_config c, int64_t S, const SeqStats* seq, double* norm) {
  tl::Sums s;
  for (int64_t i = threadIdx.x; i < S; i += blockDim.x) {
    s.n += seq[i].n;
    s.high += seq[i].n > 0;
  }
  s = BlockReduce(s);
  if (threadIdx.x == 0) {
    norm[0] = c.global_tokens > 0 ? c.global_tokens : s.n;
    norm[1] = c.global_sequences > 0 ? c.global_sequences : s.high;
  }
}

// One block per sequence: per-occurrence loss terms; contribution to the gradient per occurrence, metric sums per
// sequence.
__global__ void Occurrences(tp_loss_config c, int64_t S, const int32_t* off, int64_t M, const int32_t* pos, int64_t N,
                            const uint8_t* mask, const float* adv, const float* old, const float* ref,
                            const float* roll, const float* seq_weight, const int32_t* turn_n, const float* lp,
                            const SeqStats* seq, const double* norm, double* contrib, tl::Sums* seq_sums) {
  const bool turns = c.aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN;
  for (int64_t i = blockIdx.x; i < S; i += gridDim.x) {
    const double n = seq[i].n;
    tl::Sums s;
    int64_t a, e;
    SequenceRange(off, i, M, &a, &e);
    if (n > 0) {
      const double scale = tl::SequenceScale(c, seq_weight, i);
      const double seq_w = turns ? 0 : tl::SequenceWeight(c, n, norm[0], norm[1]) * scale;
      const double seq_lr = seq[i].log_ratio / n;
      const double seq_tis = c.tis == TP_TIS_SEQUENCE ? tl::TruncatedWeight(seq[i].log_tis, c) : 1;
      for (int64_t j = a + threadIdx.x; j < e; j += blockDim.x) {
        if (!mask[j] || pos[j] < 0 || pos[j] >= N) {
          contrib[j] = 0;
          continue;
        }
        const double tis =
            c.tis == TP_TIS_TOKEN ? tl::TruncatedWeight(static_cast<double>(old[j]) - roll[j], c) : seq_tis;
        const double w = turns ? tl::TurnWeight(norm[1], seq[i].turns, turn_n[j]) * scale : seq_w;
        const double g = tl::Occurrence(c, w, tis, seq_lr, lp[pos[j]], old[j], adv[j], ref != nullptr ? ref[j] : 0, &s);
        contrib[j] = g;
      }
    } else {
      for (int64_t j = a + threadIdx.x; j < e; j += blockDim.x) contrib[j] = 0;
    }
    s = BlockReduce(s);
    if (threadIdx.x == 0) seq_sums[i] = s;
  }
}

// Single block: the metric sums of all parts in a fixed order.
__global__ void FinishSums(const tl::Sums* parts, int64_t n, double kl_coef, tp_loss_metrics* out) {
  tl::Sums s;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s.Merge(parts[i]);
  s = BlockReduce(s);
  if (threadIdx.x == 0) s.Finish(kl_coef, out);
}

__global__ void Iota(int32_t* v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x))
    v[i] = static_cast<int32_t>(i);
}

// node_off[p] = first k with sorted_key[k] >= p, for p in [0, N]: each k fills the nodes between its key and the
// previous one, so every entry is written exactly once. Keys are clamped into [-1, N] so that a bad position
// (reported by CheckInputs) never writes outside node_off.
__device__ int64_t ClampKey(int64_t key, int64_t N) { return key < -1 ? -1 : key > N ? N : key; }

__global__ void SegmentStarts(const int32_t* sorted_key, int64_t M, int64_t N, int32_t* node_off) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k <= M;
       k += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    const int64_t prev = k == 0 ? -1 : ClampKey(sorted_key[k - 1], N);
    const int64_t cur = k == M ? N : ClampKey(sorted_key[k], N);
    for (int64_t p = prev + 1; p <= cur; p++) node_off[p] = static_cast<int32_t>(k);
  }
}

__global__ void SegmentedGrad(const int32_t* node_off, const int32_t* sorted_occ, const double* contrib, int64_t N,
                              float* grad) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < N;
       p += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    double g = 0;
    for (int32_t k = node_off[p]; k < node_off[p + 1]; k++) g += contrib[sorted_occ[k]];
    grad[p] = static_cast<float>(g);
  }
}

// Thread per node; one Sums per block.
__global__ void CompactNodes(tp_loss_config c, int64_t N, const float* lp, const float* old, const float* ref,
                             const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                             const int32_t* n_pos, const int32_t* n_neg, float* grad, tl::Sums* block_sums) {
  tl::Sums s;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < N;
       p += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    const double g = n_train[p] == 0 ? 0
                                     : tl::Node(c, lp[p], old[p], pos_w[p], neg_w[p], kl_w[p],
                                                ref != nullptr ? ref[p] : 0, n_train[p], n_pos[p], n_neg[p], &s);
    if (grad) grad[p] = static_cast<float>(g);
  }
  s = BlockReduce(s);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = s;
}

// Stream-ordered scratch, freed on every exit path (never cudaFreeAsync(nullptr): a failed allocation frees nothing).
struct Scratch {
  cudaStream_t stream;
  void* ptr = nullptr;
  explicit Scratch(cudaStream_t s) : stream(s) {}
  ~Scratch() {
    if (ptr != nullptr) cudaFreeAsync(ptr, stream);
  }
  cudaError_t alloc(size_t bytes) { return cudaMallocAsync(&ptr, bytes > 0 ? bytes : 1, stream); }
};

size_t Align(size_t x) { return (x + 255) & ~size_t(255); }

// What the host reads back after the kernels: the metrics and the input check's flags.
struct DeviceResult {
  tp_loss_metrics metrics;
  int32_t flags;
};

}  // namespace

extern "C" {

int tp_cuda_loss(const tp_loss_config* cfg, int64_t S, const int32_t* off, int64_t M, const int32_t* pos,
                 const uint8_t* mask, const float* adv, const float* old, const float* ref, const float* roll,
                 const float* seq_weight, const int32_t* turn, int64_t N, const float* lp, float* grad,
                 tp_loss_metrics* out, void* stream_ptr) {
  const int rc = tl::CheckLossArgs(cfg, S, off, M, pos, mask, adv, old, ref, roll, turn, N, lp, out);
  if (rc != TP_OK) return rc;
  const tp_loss_config c = *cfg;
  const bool turns = c.aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  size_t sort_bytes = 0, scan_bytes = 0;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(M), 0, 32, stream);
  if (err != cudaSuccess) return Fail(err);
  // The scan's count is M + 1 (the end of the last range), int64: M itself may be INT32_MAX.
  if (turns && (err = cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), static_cast<int64_t>(M + 1),
                                                    stream)) != cudaSuccess) {
    return Fail(err);
  }
  // One allocation: per-sequence stats and sums, normalisers, contributions, the sort's keys/values/scratch,
  // node offsets, the metrics with the check's flags, and in the turn mode the trainable counts, their scan and
  // each occurrence's turn size.
  const size_t sz_seq = Align(sizeof(SeqStats) * S), sz_sums = Align(sizeof(tl::Sums) * (S > 0 ? S : 1));
  const size_t sz_norm = Align(2 * sizeof(double)), sz_contrib = Align(sizeof(double) * M);
  const size_t sz_idx = Align(sizeof(int32_t) * M), sz_off = Align(sizeof(int32_t) * (N + 1));
  const size_t sz_result = Align(sizeof(DeviceResult));
  const size_t sz_turns = turns ? 2 * Align(sizeof(int32_t) * (M + 1)) + sz_idx + Align(scan_bytes) : 0;
  Scratch scratch(stream);
  if ((err = scratch.alloc(sz_seq + sz_sums + sz_norm + sz_contrib + 3 * sz_idx + sz_off + sz_result + sz_turns +
                           sort_bytes)) != cudaSuccess) {
    return Fail(err);
  }
  char* base = static_cast<char*>(scratch.ptr);
  auto take = [&base](size_t bytes) {
    char* p = base;
    base += bytes;
    return p;
  };
  auto* seq = reinterpret_cast<SeqStats*>(take(sz_seq));
  auto* seq_sums = reinterpret_cast<tl::Sums*>(take(sz_sums));
  auto* norm = reinterpret_cast<double*>(take(sz_norm));
  auto* contrib = reinterpret_cast<double*>(take(sz_contrib));
  auto* iota = reinterpret_cast<int32_t*>(take(sz_idx));
  auto* sorted_key = reinterpret_cast<int32_t*>(take(sz_idx));
  auto* sorted_occ = reinterpret_cast<int32_t*>(take(sz_idx));
  auto* node_off = reinterpret_cast<int32_t*>(take(sz_off));
  auto* d_result = reinterpret_cast<DeviceResult*>(take(sz_result));
  int32_t* trainable = turns ? reinterpret_cast<int32_t*>(take(Align(sizeof(int32_t) * (M + 1)))) : nullptr;
  int32_t* before = turns ? reinterpret_cast<int32_t*>(take(Align(sizeof(int32_t) * (M + 1)))) : nullptr;
  int32_t* turn_n = turns ? reinterpret_cast<int32_t*>(take(sz_idx)) : nullptr;
  void* scan_tmp = turns ? take(Align(scan_bytes)) : nullptr;
  void* sort_tmp = take(sort_bytes);

  if ((err = cudaMemsetAsync(&d_result->flags, 0, sizeof(int32_t), stream)) != cudaSuccess) return Fail(err);
  CheckInputs<<<BlocksFor(S + 1 > M ? S + 1 : M), kThreads, 0, stream>>>(S, off, M, pos, N, &d_result->flags);
  const unsigned seq_blocks = static_cast<unsigned>(S < 1 ? 1 : S < kMaxBlocks ? S : kMaxBlocks);
  if (turns) {
    Trainable<<<BlocksFor(M + 1), kThreads, 0, stream>>>(mask, M, trainable);
    if ((err = cub::DeviceScan::ExclusiveSum(scan_tmp, scan_bytes, trainable, before, static_cast<int64_t>(M + 1),
                                             stream)) != cudaSuccess) {
      return Fail(err);
    }
  }
  if (S > 0) {
    SequenceStats<<<seq_blocks, kThreads, 0, stream>>>(c, S, off, M, pos, N, mask, old, roll, lp, turn, before, turn_n,
                                                       &d_result->flags, seq);
  }
  Normalisers<<<1, kThreads, 0, stream>>>(c, S, seq, norm);
  if (S > 0) {
    Occurrences<<<seq_blocks, kThreads, 0, stream>>>(c, S, off, M, pos, N, mask, adv, old, ref, roll, seq_weight,
                                                     turn_n, lp, seq, norm, contrib, seq_sums);
  }
  FinishSums<<<1, kThreads, 0, stream>>>(seq_sums, S, c.kl_coef, &d_result->metrics);
  if (grad != nullptr && N > 0) {
    Iota<<<BlocksFor(M), kThreads, 0, stream>>>(iota, M);
    if (M > 0 && (err = cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, pos, sorted_key, iota, sorted_occ,
                                                        static_cast<int>(M), 0, 32, stream)) != cudaSuccess) {
      return Fail(err);
    }
    SegmentStarts<<<BlocksFor(M + 1), kThreads, 0, stream>>>(sorted_key, M, N, node_off);
    SegmentedGrad<<<BlocksFor(N), kThreads, 0, stream>>>(node_off, sorted_occ, contrib, N, grad);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return Fail(err);
  DeviceResult result;
  if ((err = cudaMemcpyAsync(&result, d_result, sizeof result, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (err = cudaStreamSynchronize(stream)) != cudaSuccess) {
    return Fail(err);
  }
  if (result.flags & kBadOffsets) return TP_ERR_OFFSETS;
  if (result.flags & kBadIndex) return TP_ERR_INDEX;
  if (result.flags & kBadTurns) return TP_ERR_TURNS;
  *out = result.metrics;
  return TP_OK;
}

int tp_cuda_loss_compact(const tp_loss_config* cfg, int64_t N, const float* lp, const float* old, const float* ref,
                         const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                         const int32_t* n_pos, const int32_t* n_neg, float* grad, tp_loss_metrics* out,
                         void* stream_ptr) {
  const int rc = tl::CheckCompactArgs(cfg, N, lp, old, ref, pos_w, neg_w, kl_w, n_train, n_pos, n_neg, out);
  if (rc != TP_OK) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const unsigned blocks = BlocksFor(N);
  Scratch scratch(stream);
  cudaError_t err = scratch.alloc(Align(sizeof(tl::Sums) * blocks) + sizeof(tp_loss_metrics));
  if (err != cudaSuccess) return Fail(err);
  auto* sums = static_cast<tl::Sums*>(scratch.ptr);
  auto* d_metrics =
      reinterpret_cast<tp_loss_metrics*>(static_cast<char*>(scratch.ptr) + Align(sizeof(tl::Sums) * blocks));
  CompactNodes<<<blocks, kThreads, 0, stream>>>(*cfg, N, lp, old, ref, pos_w, neg_w, kl_w, n_train, n_pos, n_neg, grad,
                                                sums);
  FinishSums<<<1, kThreads, 0, stream>>>(sums, blocks, cfg->kl_coef, d_metrics);
  if ((err = cudaGetLastError()) != cudaSuccess) return Fail(err);
  if ((err = cudaMemcpyAsync(out, d_metrics, sizeof(tp_loss_metrics), cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (err = cudaStreamSynchronize(stream)) != cudaSuccess) {
    return Fail(err);
  }
  return TP_OK;
}

// Host-memory wrappers for the addon: copy in, run, copy the gradient back. Every array goes into one device
// allocation so that a failure anywhere frees everything.
int tp_cuda_loss_host(const tp_loss_config* cfg, int64_t S, const int32_t* off, int64_t M, const int32_t* pos,
                      const uint8_t* mask, const float* adv, const float* old, const float* ref, const float* roll,
                      const float* seq_weight, const int32_t* turn, int64_t N, const float* lp, float* grad,
                      tp_loss_metrics* out) {
  // Null host arrays are refused here: a device buffer standing in for one would be read uninitialised.
  int rc = tl::CheckLossArgs(cfg, S, off, M, pos, mask, adv, old, ref, roll, turn, N, lp, out);
  if (rc != TP_OK) return rc;
  const bool with_ref = cfg->kl != TP_KL_NONE && ref != nullptr, with_roll = cfg->tis != TP_TIS_NONE && roll != nullptr;
  const bool with_turns = cfg->aggregation == TP_AGG_SEQ_MEAN_TURN_MEAN_TOKEN_MEAN && turn != nullptr;
  const size_t fm = Align(sizeof(float) * M), im = Align(sizeof(int32_t) * M), fn = Align(sizeof(float) * N);
  const size_t fs = Align(sizeof(float) * S);
  const size_t total = Align(sizeof(int32_t) * (S + 1)) + 2 * im + Align(M) + 4 * fm + fs + 2 * fn;
  Scratch dev(nullptr);
  cudaError_t err = dev.alloc(total);
  if (err != cudaSuccess) return Fail(err);
  char* base = static_cast<char*>(dev.ptr);
  struct Copy {
    const void* src;
    size_t bytes, room;
  } copies[] = {{off, sizeof(int32_t) * (S + 1), Align(sizeof(int32_t) * (S + 1))},
                {pos, sizeof(int32_t) * M, im},
                {mask, static_cast<size_t>(M), Align(M)},
                {adv, sizeof(float) * M, fm},
                {old, sizeof(float) * M, fm},
                {with_ref ? ref : nullptr, sizeof(float) * M, fm},
                {with_roll ? roll : nullptr, sizeof(float) * M, fm},
                {seq_weight, sizeof(float) * S, fs},
                {with_turns ? turn : nullptr, sizeof(int32_t) * M, im},
                {lp, sizeof(float) * N, fn}};
  void* d[10];
  for (int k = 0; k < 10; k++) {
    d[k] = base;
    base += copies[k].room;
    if (copies[k].src != nullptr && copies[k].bytes > 0 &&
        (err = cudaMemcpy(d[k], copies[k].src, copies[k].bytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
      return Fail(err);
    }
  }
  float* d_grad = reinterpret_cast<float*>(base);
  rc =
      tp_cuda_loss(cfg, S, static_cast<int32_t*>(d[0]), M, static_cast<int32_t*>(d[1]), static_cast<uint8_t*>(d[2]),
                   static_cast<float*>(d[3]), static_cast<float*>(d[4]), with_ref ? static_cast<float*>(d[5]) : nullptr,
                   with_roll ? static_cast<float*>(d[6]) : nullptr, seq_weight ? static_cast<float*>(d[7]) : nullptr,
                   with_turns ? static_cast<int32_t*>(d[8]) : nullptr, N, static_cast<float*>(d[9]),
                   grad ? d_grad : nullptr, out, nullptr);
  if (rc != TP_OK) return rc;
  if (grad != nullptr && N > 0 &&
      (err = cudaMemcpy(grad, d_grad, sizeof(float) * N, cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return Fail(err);
  }
  return TP_OK;
}

int tp_cuda_loss_compact_host(const tp_loss_config* cfg, int64_t N, const float* lp, const float* old, const float* ref,
                              const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                              const int32_t* n_pos, const int32_t* n_neg, float* grad, tp_loss_metrics* out) {
  int rc = tl::CheckCompactArgs(cfg, N, lp, old, ref, pos_w, neg_w, kl_w, n_train, n_pos, n_neg, out);
  if (rc != TP_OK) return rc;
  const size_t fn = Align(sizeof(float) * (N > 0 ? N : 1));
  const void* src[] = {lp, old, cfg->kl != TP_KL_NONE ? ref : nullptr, pos_w, neg_w, kl_w, n_train, n_pos, n_neg};
  Scratch dev(nullptr);
  cudaError_t err = dev.alloc(10 * fn);
  if (err != cudaSuccess) return Fail(err);
  char* d[10];
  for (int k = 0; k < 10; k++) {
    d[k] = static_cast<char*>(dev.ptr) + k * fn;
    if (k < 9 && src[k] != nullptr && N > 0 &&
        (err = cudaMemcpy(d[k], src[k], sizeof(float) * N, cudaMemcpyHostToDevice)) != cudaSuccess) {
      return Fail(err);
    }
  }
  rc = tp_cuda_loss_compact(
      cfg, N, reinterpret_cast<float*>(d[0]), reinterpret_cast<float*>(d[1]),
      src[2] ? reinterpret_cast<float*>(d[2]) : nullptr, reinterpret_cast<float*>(d[3]), reinterpret_cast<float*>(d[4]),
      reinterpret_cast<float*>(d[5]), reinterpret_cast<int32_t*>(d[6]), reinterpret_cast<int32_t*>(d[7]),
      reinterpret_cast<int32_t*>(d[8]), grad ? reinterpret_cast<float*>(d[9]) : nullptr, out, nullptr);
  if (rc != TP_OK) return rc;
  if (grad != nullptr && N > 0 &&
      (err = cudaMemcpy(grad, d[9], sizeof(float) * N, cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return Fail(err);
  }
  return TP_OK;
}

}  // extern "C"
