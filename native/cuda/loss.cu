// The RL loss on the GPU, deterministic: no float atomics anywhere, every sum in a fixed order, so results are
// bit-identical run to run. The gradient is a segmented reduction keyed by the unmerge index: occurrences are
// stably sorted by node (CUB radix sort), and each node sums its occurrences' contributions in that order.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include "../core/loss_math.h"
#include "treepack_cuda.h"

namespace tl = treepack::loss;

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
  double n, log_ratio, log_tis;
};

// One block per sequence: trainable count, GSPO's summed log ratio, the sequence-level TIS log weight.
__global__ void SequenceStats(tp_loss_config c, int64_t S, const int32_t* off, const int32_t* pos,
                              const uint8_t* mask, const float* old, const float* roll, const float* lp,
                              SeqStats* out) {
  for (int64_t i = blockIdx.x; i < S; i += gridDim.x) {
    tl::Sums s;  // n, log_ratio and ratio fields carry the three sums
    for (int64_t j = off[i] + threadIdx.x; j < off[i + 1]; j += blockDim.x) {
      if (!mask[j]) continue;
      s.n += 1;
      if (c.policy == TP_POLICY_GSPO) s.log_ratio += static_cast<double>(lp[pos[j]]) - old[j];
      if (c.tis == TP_TIS_SEQUENCE) s.ratio += static_cast<double>(old[j]) - roll[j];
    }
    s = BlockReduce(s);
    if (threadIdx.x == 0) out[i] = SeqStats{s.n, s.log_ratio, s.ratio};
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
__global__ void Occurrences(tp_loss_config c, int64_t S, const int32_t* off, const int32_t* pos, const uint8_t* mask,
                            const float* adv, const float* old, const float* ref, const float* roll, const float* lp,
                            const SeqStats* seq, const double* norm, double* contrib, tl::Sums* seq_sums) {
  for (int64_t i = blockIdx.x; i < S; i += gridDim.x) {
    const double n = seq[i].n;
    tl::Sums s;
    if (n > 0) {
      const double w = tl::SequenceWeight(c, n, norm[0], norm[1]);
      const double seq_lr = seq[i].log_ratio / n;
      const double seq_tis = c.tis == TP_TIS_SEQUENCE ? tl::TruncatedWeight(seq[i].log_tis, c) : 1;
      for (int64_t j = off[i] + threadIdx.x; j < off[i + 1]; j += blockDim.x) {
        if (!mask[j]) {
          contrib[j] = 0;
          continue;
        }
        const double tis = c.tis == TP_TIS_TOKEN ? tl::TruncatedWeight(static_cast<double>(old[j]) - roll[j], c) : seq_tis;
        const double g = tl::Occurrence(c, w, tis, seq_lr, lp[pos[j]], old[j], adv[j], ref != nullptr ? ref[j] : 0, &s);
        contrib[j] = g;
      }
    } else {
      for (int64_t j = off[i] + threadIdx.x; j < off[i + 1]; j += blockDim.x) contrib[j] = 0;
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
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * static_cast<int64_t>(blockDim.x))
    v[i] = static_cast<int32_t>(i);
}

// node_off[p] = first k with sorted_key[k] >= p, for p in [0, N]: each k fills the nodes between its key and the
// previous one, so every entry is written exactly once.
__global__ void SegmentStarts(const int32_t* sorted_key, int64_t M, int64_t N, int32_t* node_off) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k <= M; k += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    const int64_t prev = k == 0 ? -1 : sorted_key[k - 1];
    const int64_t cur = k == M ? N : sorted_key[k];
    for (int64_t p = prev + 1; p <= cur && p <= N; p++) node_off[p] = static_cast<int32_t>(k);
  }
}

__global__ void SegmentedGrad(const int32_t* node_off, const int32_t* sorted_occ, const double* contrib, int64_t N, float* grad) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < N; p += gridDim.x * static_cast<int64_t>(blockDim.x)) {
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
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < N; p += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    const double g = n_train[p] == 0 ? 0
                                     : tl::Node(c, lp[p], old[p], pos_w[p], neg_w[p], kl_w[p], ref != nullptr ? ref[p] : 0,
                                                n_train[p], n_pos[p], n_neg[p], &s);
    if (grad) grad[p] = static_cast<float>(g);
  }
  s = BlockReduce(s);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = s;
}

// Stream-ordered scratch, freed on every exit path.
struct Scratch {
  cudaStream_t stream;
  void* ptr = nullptr;
  explicit Scratch(cudaStream_t s) : stream(s) {}
  ~Scratch() { cudaFreeAsync(ptr, stream); }
  cudaError_t alloc(size_t bytes) { return cudaMallocAsync(&ptr, bytes > 0 ? bytes : 1, stream); }
};

size_t Align(size_t x) { return (x + 255) & ~size_t(255); }

bool ConfigOk(const tp_loss_config* c) {
  return c != nullptr && c->policy >= 0 && c->policy <= 2 && c->aggregation >= 0 && c->aggregation <= 3 &&
         c->kl >= 0 && c->kl <= 4 && c->tis >= 0 && c->tis <= 2;
}

}  // namespace

extern "C" {

int tp_cuda_loss(const tp_loss_config* cfg, int64_t S, const int32_t* off, int64_t M, const int32_t* pos,
                 const uint8_t* mask, const float* adv, const float* old, const float* ref, const float* roll,
                 int64_t N, const float* lp, float* grad, tp_loss_metrics* out, void* stream_ptr) {
  if (!ConfigOk(cfg) || out == nullptr || S < 0 || M < 0 || N < 0 || M > INT32_MAX || off == nullptr) return cudaErrorInvalidValue;
  if (M > 0 && (pos == nullptr || mask == nullptr || adv == nullptr || old == nullptr || lp == nullptr ||
                (cfg->kl != TP_KL_NONE && ref == nullptr) || (cfg->tis != TP_TIS_NONE && roll == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const tp_loss_config c = *cfg;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  size_t sort_bytes = 0;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), static_cast<int>(M), 0, 32, stream);
  if (err != cudaSuccess) return err;
  // One allocation: per-sequence stats and sums, normalisers, contributions, the sort's keys/values/scratch,
  // node offsets and the metrics.
  const size_t sz_seq = Align(sizeof(SeqStats) * S), sz_sums = Align(sizeof(tl::Sums) * (S > 0 ? S : 1));
  const size_t sz_norm = Align(2 * sizeof(double)), sz_contrib = Align(sizeof(double) * M);
  const size_t sz_idx = Align(sizeof(int32_t) * M), sz_off = Align(sizeof(int32_t) * (N + 1));
  const size_t sz_metrics = Align(sizeof(tp_loss_metrics));
  Scratch scratch(stream);
  if ((err = scratch.alloc(sz_seq + sz_sums + sz_norm + sz_contrib + 3 * sz_idx + sz_off + sz_metrics + sort_bytes)) != cudaSuccess) return err;
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
  auto* d_metrics = reinterpret_cast<tp_loss_metrics*>(take(sz_metrics));
  void* sort_tmp = take(sort_bytes);

  const unsigned seq_blocks = static_cast<unsigned>(S < 1 ? 1 : S < kMaxBlocks ? S : kMaxBlocks);
  if (S > 0) {
    SequenceStats<<<seq_blocks, kThreads, 0, stream>>>(c, S, off, pos, mask, old, roll, lp, seq);
  }
  Normalisers<<<1, kThreads, 0, stream>>>(c, S, seq, norm);
  if (S > 0) {
    Occurrences<<<seq_blocks, kThreads, 0, stream>>>(c, S, off, pos, mask, adv, old, ref, roll, lp, seq, norm, contrib, seq_sums);
  }
  FinishSums<<<1, kThreads, 0, stream>>>(seq_sums, S, c.kl_coef, d_metrics);
  if (grad != nullptr && N > 0) {
    Iota<<<BlocksFor(M), kThreads, 0, stream>>>(iota, M);
    if (M > 0 && (err = cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, pos, sorted_key, iota, sorted_occ,
                                                       static_cast<int>(M), 0, 32, stream)) != cudaSuccess) {
      return err;
    }
    SegmentStarts<<<BlocksFor(M + 1), kThreads, 0, stream>>>(sorted_key, M, N, node_off);
    SegmentedGrad<<<BlocksFor(N), kThreads, 0, stream>>>(node_off, sorted_occ, contrib, N, grad);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = cudaMemcpyAsync(out, d_metrics, sizeof(tp_loss_metrics), cudaMemcpyDeviceToHost, stream)) != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

int tp_cuda_loss_compact(const tp_loss_config* cfg, int64_t N, const float* lp, const float* old, const float* ref,
                         const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                         const int32_t* n_pos, const int32_t* n_neg, float* grad, tp_loss_metrics* out, void* stream_ptr) {
  if (!ConfigOk(cfg) || out == nullptr || N < 0 || cfg->policy == TP_POLICY_GSPO) return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const unsigned blocks = BlocksFor(N);
  Scratch scratch(stream);
  cudaError_t err = scratch.alloc(Align(sizeof(tl::Sums) * blocks) + sizeof(tp_loss_metrics));
  if (err != cudaSuccess) return err;
  auto* sums = static_cast<tl::Sums*>(scratch.ptr);
  auto* d_metrics = reinterpret_cast<tp_loss_metrics*>(static_cast<char*>(scratch.ptr) + Align(sizeof(tl::Sums) * blocks));
  CompactNodes<<<blocks, kThreads, 0, stream>>>(*cfg, N, lp, old, ref, pos_w, neg_w, kl_w, n_train, n_pos, n_neg, grad, sums);
  FinishSums<<<1, kThreads, 0, stream>>>(sums, blocks, cfg->kl_coef, d_metrics);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = cudaMemcpyAsync(out, d_metrics, sizeof(tp_loss_metrics), cudaMemcpyDeviceToHost, stream)) != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// Host-memory wrappers for the addon: copy in, run, copy the gradient back. Every array goes into one device
// allocation so that a failure anywhere frees everything.
int tp_cuda_loss_host(const tp_loss_config* cfg, int64_t S, const int32_t* off, const int32_t* pos, const uint8_t* mask,
                      const float* adv, const float* old, const float* ref, const float* roll, int64_t N,
                      const float* lp, float* grad, tp_loss_metrics* out) {
  if (cfg == nullptr || S < 0 || N < 0 || off == nullptr) return cudaErrorInvalidValue;
  const int64_t M = off[S];
  const bool with_ref = cfg->kl != TP_KL_NONE && ref != nullptr, with_roll = cfg->tis != TP_TIS_NONE && roll != nullptr;
  const size_t fm = Align(sizeof(float) * M), im = Align(sizeof(int32_t) * M), fn = Align(sizeof(float) * N);
  const size_t total = Align(sizeof(int32_t) * (S + 1)) + im + Align(M) + 4 * fm + 2 * fn;
  Scratch dev(nullptr);
  cudaError_t err = dev.alloc(total);
  if (err != cudaSuccess) return err;
  char* base = static_cast<char*>(dev.ptr);
  struct Copy {
    const void* src;
    size_t bytes, room;
  } copies[] = {{off, sizeof(int32_t) * (S + 1), Align(sizeof(int32_t) * (S + 1))}, {pos, sizeof(int32_t) * M, im},
                {mask, static_cast<size_t>(M), Align(M)}, {adv, sizeof(float) * M, fm}, {old, sizeof(float) * M, fm},
                {with_ref ? ref : nullptr, sizeof(float) * M, fm}, {with_roll ? roll : nullptr, sizeof(float) * M, fm},
                {lp, sizeof(float) * N, fn}};
  void* d[8];
  for (int k = 0; k < 8; k++) {
    d[k] = base;
    base += copies[k].room;
    if (copies[k].src != nullptr && copies[k].bytes > 0 &&
        (err = cudaMemcpy(d[k], copies[k].src, copies[k].bytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
      return err;
    }
  }
  float* d_grad = reinterpret_cast<float*>(base);
  err = static_cast<cudaError_t>(tp_cuda_loss(
      cfg, S, static_cast<int32_t*>(d[0]), M, static_cast<int32_t*>(d[1]), static_cast<uint8_t*>(d[2]),
      static_cast<float*>(d[3]), static_cast<float*>(d[4]), with_ref ? static_cast<float*>(d[5]) : nullptr,
      with_roll ? static_cast<float*>(d[6]) : nullptr, N, static_cast<float*>(d[7]), grad ? d_grad : nullptr, out, nullptr));
  if (err != cudaSuccess) return err;
  if (grad != nullptr && N > 0) return cudaMemcpy(grad, d_grad, sizeof(float) * N, cudaMemcpyDeviceToHost);
  return cudaSuccess;
}

int tp_cuda_loss_compact_host(const tp_loss_config* cfg, int64_t N, const float* lp, const float* old, const float* ref,
                              const float* pos_w, const float* neg_w, const float* kl_w, const int32_t* n_train,
                              const int32_t* n_pos, const int32_t* n_neg, float* grad, tp_loss_metrics* out) {
  if (cfg == nullptr || N < 0) return cudaErrorInvalidValue;
  const size_t fn = Align(sizeof(float) * (N > 0 ? N : 1));
  const void* src[] = {lp, old, cfg->kl != TP_KL_NONE ? ref : nullptr, pos_w, neg_w, kl_w, n_train, n_pos, n_neg};
  Scratch dev(nullptr);
  cudaError_t err = dev.alloc(10 * fn);
  if (err != cudaSuccess) return err;
  char* d[10];
  for (int k = 0; k < 10; k++) {
    d[k] = static_cast<char*>(dev.ptr) + k * fn;
    if (k < 9 && src[k] != nullptr && N > 0 &&
        (err = cudaMemcpy(d[k], src[k], sizeof(float) * N, cudaMemcpyHostToDevice)) != cudaSuccess) {
      return err;
    }
  }
  err = static_cast<cudaError_t>(tp_cuda_loss_compact(
      cfg, N, reinterpret_cast<float*>(d[0]), reinterpret_cast<float*>(d[1]), src[2] ? reinterpret_cast<float*>(d[2]) : nullptr,
      reinterpret_cast<float*>(d[3]), reinterpret_cast<float*>(d[4]), reinterpret_cast<float*>(d[5]),
      reinterpret_cast<int32_t*>(d[6]), reinterpret_cast<int32_t*>(d[7]), reinterpret_cast<int32_t*>(d[8]),
      grad ? reinterpret_cast<float*>(d[9]) : nullptr, out, nullptr));
  if (err != cudaSuccess) return err;
  if (grad != nullptr && N > 0) return cudaMemcpy(grad, d[9], sizeof(float) * N, cudaMemcpyDeviceToHost);
  return cudaSuccess;
}

}  // extern "C"
