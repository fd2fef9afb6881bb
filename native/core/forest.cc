// The prefix forest of a batch of token sequences, laid out exactly as the TypeScript reference
// (src/pack/forest.ts): sort the sequences lexicographically, then sorted sequence k adds its tokens past
// lcp(k-1, k) in DFS preorder.
//
// The sort is a natural LCP merge sort. Agent rollouts arrive as chains (request k+1 extends request k), so the
// input is mostly made of already sorted runs; one pass compares neighbours, keeping their LCPs, and the merges
// then only compare heads whose LCPs with the last output tie (Ng & Kakehi), never rescanning a shared prefix.
// On such data every token is read from memory about once, which is what keeps the packer near a plain copy.
//
// The memory traffic is then the floor: the tokens read once (the neighbour pass, prefetching ahead) and
// seq_positions written once (from a path buffer in cache, with streaming stores when the outputs outgrow the
// cache). What is left over is made small: merge ties are mostly decided by a cached key, a merge's first
// comparison starts past the prefix all its sequences share, and the layout reads back nothing it wrote.
#include "treepack.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TP_X86_SIMD 1
#include <immintrin.h>
#endif

struct tp_plan {
  const int32_t* tokens;
  const int32_t* offsets;
  int32_t num_seqs;
  int64_t num_nodes;
  int32_t* order;  // [S] sequence indices in sorted order
  int32_t* lcp;    // [S] lcp[k] = common prefix length of order[k-1] and order[k]; lcp[0] = 0
  int32_t* spare;  // [2S] merge buffers during the sort, the open-path stack during the layout
  int32_t* path;   // [path_cap] the positions of the current sequence's path during the layout
  int32_t path_cap;
};

namespace {

// How far ahead of a scan of b to prefetch, with Prefetch. The run detection reads the batch front to back, b
// being the sequence it reads for the first time; one stream of loads that each wait for DRAM leaves the hardware
// prefetcher behind, so asking 8 KiB ahead brings the scan near a plain read. Prefetching past b (into the
// sequences read next, or past the batch) is harmless: it never faults.
constexpr uintptr_t kPrefetchBytes = 8192;

inline void prefetch_ahead(const int32_t* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes));
}

// First index in [from, n) where a and b differ, or n. Shared prefixes of agent data are thousands of tokens, so the
// scan runs 64 bytes a step and only looks for the exact token once a step differs.
#ifdef TP_X86_SIMD
// The check runs once per process.
inline bool has_avx2() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return yes;
}

template <bool Prefetch>
__attribute__((target("avx2"))) int64_t mismatch_avx2(const int32_t* a, const int32_t* b, int64_t from, int64_t n) {
  int64_t i = from;
  for (; n - i >= 16; i += 16) {
    if (Prefetch) prefetch_ahead(b + i);
    const __m256i e0 = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i)),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
    const __m256i e1 = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i + 8)),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 8)));
    if (static_cast<unsigned>(_mm256_movemask_epi8(_mm256_and_si256(e0, e1))) != 0xffffffffu) {
      const unsigned m0 = static_cast<unsigned>(_mm256_movemask_epi8(e0));
      if (m0 != 0xffffffffu) return i + (__builtin_ctz(~m0) >> 2);
      return i + 8 + (__builtin_ctz(~static_cast<unsigned>(_mm256_movemask_epi8(e1))) >> 2);
    }
  }
  for (; i < n && a[i] == b[i]; i++) {
  }
  return i;
}

template <bool Prefetch>
int64_t mismatch_sse2(const int32_t* a, const int32_t* b, int64_t from, int64_t n) {
  int64_t i = from;
  for (; n - i >= 16; i += 16) {
    if (Prefetch) prefetch_ahead(b + i);
    __m128i e[4];
    for (int q = 0; q < 4; q++) {
      e[q] = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i + 4 * q)),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + 4 * q)));
    }
    if (_mm_movemask_epi8(_mm_and_si128(_mm_and_si128(e[0], e[1]), _mm_and_si128(e[2], e[3]))) != 0xffff) {
      for (int q = 0;; q++) {
        const unsigned m = static_cast<unsigned>(_mm_movemask_epi8(e[q]));
        if (m != 0xffff) return i + 4 * q + (__builtin_ctz(~m) >> 2);
      }
    }
  }
  for (; i < n && a[i] == b[i]; i++) {
  }
  return i;
}

template <bool Prefetch>
inline int64_t mismatch(const int32_t* a, const int32_t* b, int64_t from, int64_t n) {
  // AVX2 halves the steps of the SSE2 loop (x86-64's baseline).
  return has_avx2() ? mismatch_avx2<Prefetch>(a, b, from, n) : mismatch_sse2<Prefetch>(a, b, from, n);
}
#else
template <bool Prefetch>
inline int64_t mismatch(const int32_t* a, const int32_t* b, int64_t from, int64_t n) {
  int64_t i = from;
  for (; i + 2 <= n; i += 2) {
    if (Prefetch && (i & 15) == 0) prefetch_ahead(b + i);
    uint64_t x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    if (x != y) return a[i] == b[i] ? i + 1 : i;
  }
  for (; i < n && a[i] == b[i]; i++) {
  }
  return i;
}
#endif

// The sort keeps, for every element, its LCP with the element before it and its key: its token at that LCP, or kEnd
// where the sequence ends there. On a merge tie the two keys decide without touching the tokens, which are far
// apart in memory by then; only heads whose keys tie too are scanned, from one past the tie.
constexpr int64_t kEnd = INT64_MIN;  // below every token: a proper prefix precedes its extensions

inline int64_t key_at(const int32_t* tokens, int32_t start, int32_t len, int32_t h) {
  return h < len ? tokens[start + h] : kEnd;
}

struct Compared {
  int32_t lcp;
  int64_t key_a, key_b;                            // a's and b's keys at lcp
  bool a_first() const { return key_a <= key_b; }  // a sorts before b, or they are equal
};

// Compares sequences a and b, which are known to agree on their first `from` tokens.
template <bool Prefetch = false>
inline Compared compare(const int32_t* tokens, const int32_t* offsets, int32_t a, int32_t b, int32_t from) {
  const int32_t sa = offsets[a], la = offsets[a + 1] - sa;
  const int32_t sb = offsets[b], lb = offsets[b + 1] - sb;
  const int32_t h = static_cast<int32_t>(mismatch<Prefetch>(tokens + sa, tokens + sb, from, std::min(la, lb)));
  return {h, key_at(tokens, sa, la, h), key_at(tokens, sb, lb, h)};
}

// Sequence indices in sorted order with, per element, the LCP with the element before it and the key at that LCP.
// A run's first element has LCP 0.
struct Sorted {
  int32_t* order;
  int32_t* lcp;
  int64_t* key;
};

// The runs of a merge pass. Run r holds the input sequences start[r] .. start[r+1]-1, in some order. Any two
// sequences of a run share at least floor[r] tokens, the smallest LCP of two input neighbours inside it, and link[r]
// is the LCP of the input neighbours across its end. So the first comparison of a merge starts at the floor instead
// of 0: agent batches open every sequence with the same long system prompt, which would otherwise be rescanned
// once per merge.
struct Runs {
  int32_t* start;
  int32_t* floor;
  int32_t* link;
};

// Splits 0..S into maximal sorted runs: ascending, or strictly descending and then reversed in place (strictness
// keeps equal sequences in input order, as the reference's stable sort does). Writes the runs to `out` and `runs`;
// returns their number.
int32_t find_runs(const int32_t* tokens, const int32_t* offsets, int32_t S, Sorted out, Runs runs) {
  int32_t num_runs = 0;
  int32_t i = 0;
  while (i < S) {
    out.order[i] = i;
    out.lcp[i] = 0;
    int32_t j = i, floor = INT32_MAX;
    runs.link[num_runs] = 0;  // stays for the last run, which has no neighbour
    if (j + 1 < S) {
      Compared c = compare<true>(tokens, offsets, j, j + 1, 0);
      const bool ascending = c.a_first();
      while (c.a_first() == ascending) {
        ++j;
        out.order[j] = j;
        // lcp(j-1, j) is symmetric; the key is that of whichever of the two comes second once the run is sorted.
        out.lcp[j] = c.lcp;
        out.key[j] = ascending ? c.key_b : c.key_a;
        floor = std::min(floor, c.lcp);
        if (j + 1 == S) break;
        c = compare<true>(tokens, offsets, j, j + 1, 0);
      }
      if (j + 1 < S) runs.link[num_runs] = c.lcp;  // the comparison that ended the run
      if (!ascending) {
        std::reverse(out.order + i, out.order + j + 1);
        std::reverse(out.lcp + i + 1, out.lcp + j + 1);
        std::reverse(out.key + i + 1, out.key + j + 1);
      }
    }
    const int32_t first = out.order[i];
    out.key[i] = key_at(tokens, offsets[first], offsets[first + 1] - offsets[first], 0);
    runs.start[num_runs] = i;
    runs.floor[num_runs++] = floor;
    i = j + 1;
  }
  return num_runs;
}

// Merges the sorted runs [lo, mid) and [mid, hi) of `in`, whose sequences all share their first `floor` tokens,
// into `out` at lo. hA and hB are the LCPs of the two heads with the last element written and kA, kB their keys:
// the larger LCP goes first without looking at a token, a tie is decided by the keys, and only a tie of keys too is
// resolved by scanning the tokens.
void merge(const int32_t* tokens, const int32_t* offsets, Sorted in, int32_t lo, int32_t mid, int32_t hi, int32_t floor,
           Sorted out) {
  int32_t i = lo, j = mid, at = lo;
  int32_t hA = in.lcp[i], hB = in.lcp[j];  // 0: a run's first element
  int64_t kA = in.key[i], kB = in.key[j];
  const auto take_a = [&] {
    out.order[at] = in.order[i];
    out.lcp[at] = hA;
    out.key[at++] = kA;
    if (++i < mid) hA = in.lcp[i], kA = in.key[i];
  };
  const auto take_b = [&] {
    out.order[at] = in.order[j];
    out.lcp[at] = hB;
    out.key[at++] = kB;
    if (++j < hi) hB = in.lcp[j], kB = in.key[j];
  };
  // Scans the heads from `from`, writes the smaller, and keeps the other's LCP and key with it.
  const auto take_scanned = [&](int32_t from) {
    const Compared c = compare(tokens, offsets, in.order[i], in.order[j], from);
    if (c.a_first()) {
      take_a();
      hB = c.lcp, kB = c.key_b;
    } else {
      take_b();
      hA = c.lcp, kA = c.key_a;
    }
  };
  take_scanned(floor);  // nothing is written yet: the heads are compared with each other
  while (i < mid && j < hi) {
    if (hA != hB) {
      hA > hB ? take_a() : take_b();
    } else if (kA != kB || kA == kEnd) {
      // They differ at hA (or are equal): the one written leaves the other's LCP and key with it unchanged.
      kA <= kB ? take_a() : take_b();
    } else {
      take_scanned(hA + 1);
    }
  }
  // The first element of the leftover run carries its LCP and key with the last written element, the rest keep
  // theirs.
  const int32_t rest = i < mid ? i : j, rest_end = i < mid ? mid : hi;
  if (rest < rest_end) {
    std::memcpy(out.order + at, in.order + rest, sizeof(int32_t) * (rest_end - rest));
    std::memcpy(out.lcp + at, in.lcp + rest, sizeof(int32_t) * (rest_end - rest));
    std::memcpy(out.key + at, in.key + rest, sizeof(int64_t) * (rest_end - rest));
    out.lcp[at] = i < mid ? hA : hB;
    out.key[at] = i < mid ? kA : kB;
  }
}

// Sorts with `a` and `b` as the two buffers of the merge passes and `runs` (S entries each) as scratch; returns the
// buffer that holds the result.
Sorted sort_sequences(const int32_t* tokens, const int32_t* offsets, int32_t S, Sorted a, Sorted b, Runs runs) {
  int32_t num_runs = find_runs(tokens, offsets, S, a, runs);
  while (num_runs > 1) {
    int32_t kept = 0;
    for (int32_t r = 0; r < num_runs; r += 2) {
      const int32_t lo = runs.start[r];
      if (r + 1 == num_runs) {
        std::memcpy(b.order + lo, a.order + lo, sizeof(int32_t) * (S - lo));
        std::memcpy(b.lcp + lo, a.lcp + lo, sizeof(int32_t) * (S - lo));
        std::memcpy(b.key + lo, a.key + lo, sizeof(int64_t) * (S - lo));
        runs.floor[kept] = runs.floor[r];
      } else {
        const int32_t floor = std::min({runs.floor[r], runs.link[r], runs.floor[r + 1]});
        merge(tokens, offsets, a, lo, runs.start[r + 1], r + 2 < num_runs ? runs.start[r + 2] : S, floor, b);
        runs.floor[kept] = floor;
        runs.link[kept] = runs.link[r + 1];
      }
      runs.start[kept++] = lo;  // kept <= r, so the entries still to be read are untouched
    }
    num_runs = kept;
    std::swap(a, b);
  }
  return a;
}

// Counts are int32 here: a 64-bit counter makes GCC widen the iota's vector lanes and narrow them back every step.
inline void iota(int32_t* __restrict dst, int32_t n, int32_t first) {
  for (int32_t t = 0; t < n; t++) dst[t] = first + t;
}

inline void fill(int32_t* __restrict dst, int32_t n, int32_t value) {
  for (int32_t t = 0; t < n; t++) dst[t] = value;
}

// The tokens a sequence adds are the only ones the layout reads, a few hundred scattered over the batch for each
// agent request: fetched while the sequence before is laid out, they cost no wait on DRAM. The first 4 KiB is enough
// for the hardware prefetcher to take over a longer run.
inline void prefetch_fresh(const int32_t* tokens, const int32_t* offsets, int32_t s, int32_t h) {
  const char* p = reinterpret_cast<const char*>(tokens + offsets[s] + h);
  const char* end = reinterpret_cast<const char*>(tokens + offsets[s + 1]);
  if (end - p > 4096) end = p + 4096;
  for (; p < end; p += 64) {
    __builtin_prefetch(p);
    // GCC counts a prefetch as no side effect and deletes a loop of nothing else; an empty asm keeps it.
    asm volatile("" : : "r"(p));
  }
}

// The longest sequence whose positions the layout assembles in a buffer (256 KiB, which stays in cache) before
// copying them out; a longer one takes them from the path's segments directly, which writes each position once but
// pays for every segment boundary.
constexpr int32_t kPathTokens = 1 << 16;

// Outputs past this size cannot stay in the cache for the caller anyway; below it, streaming would only evict them.
constexpr size_t kStreamBytes = size_t{32} << 20;

#ifdef TP_X86_SIMD
// In cache too, AVX2's 32-byte stores fill the node arrays nearly twice as fast as the baseline's 16-byte ones.
__attribute__((target("avx2"))) void iota_avx2(int32_t* __restrict dst, int32_t n, int32_t first) {
  for (int32_t t = 0; t < n; t++) dst[t] = first + t;
}

__attribute__((target("avx2"))) void fill_avx2(int32_t* __restrict dst, int32_t n, int32_t value) {
  for (int32_t t = 0; t < n; t++) dst[t] = value;
}

// Streaming stores of int32 runs: every whole 64-byte line is written with two non-temporal 32-byte stores, which
// skip reading the line before overwriting it; the partial lines at a run's ends take plain stores, so no line is
// ever written both ways at once.
inline int32_t whole_lines_from(const int32_t* dst, int32_t n) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(dst);
  if (address % alignof(int32_t) != 0) return n;  // not from the C ABI's callers; plain stores cope
  const int32_t head = static_cast<int32_t>((-address & 63) / sizeof(int32_t));
  return head + 16 <= n ? head : n;
}

__attribute__((target("avx2"))) void stream_iota(int32_t* dst, int32_t n, int32_t first) {
  int32_t i = whole_lines_from(dst, n);
  iota(dst, i, first);
  const __m256i eight = _mm256_set1_epi32(8);
  __m256i v = _mm256_add_epi32(_mm256_set1_epi32(first + i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (; n - i >= 16; i += 16) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), v);
    v = _mm256_add_epi32(v, eight);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 8), v);
    v = _mm256_add_epi32(v, eight);
  }
  iota(dst + i, n - i, first + i);
}

__attribute__((target("avx2"))) void stream_fill(int32_t* dst, int32_t n, int32_t value) {
  int32_t i = whole_lines_from(dst, n);
  fill(dst, i, value);
  const __m256i v = _mm256_set1_epi32(value);
  for (; n - i >= 16; i += 16) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 8), v);
  }
  fill(dst + i, n - i, value);
}

__attribute__((target("avx2"))) void stream_copy(int32_t* dst, const int32_t* src, int32_t n) {
  int32_t i = whole_lines_from(dst, n);
  std::memcpy(dst, src, sizeof(int32_t) * static_cast<size_t>(i));
  for (; n - i >= 16; i += 16) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 8),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
  }
  std::memcpy(dst + i, src + i, sizeof(int32_t) * static_cast<size_t>(n - i));
}
#endif

// The layout's writes: streaming for outputs past kStreamBytes where AVX2 is there, plain stores otherwise.
class Stores {
 public:
  explicit Stores(size_t bytes) {
#ifdef TP_X86_SIMD
    avx2_ = has_avx2();
    stream_ = bytes >= kStreamBytes && avx2_;
#else
    (void)bytes;
#endif
  }

  void iota(int32_t* dst, int32_t n, int32_t first) const {
#ifdef TP_X86_SIMD
    if (stream_) return stream_iota(dst, n, first);
    if (avx2_) return iota_avx2(dst, n, first);
#endif
    ::iota(dst, n, first);
  }

  void fill(int32_t* dst, int32_t n, int32_t value) const {
#ifdef TP_X86_SIMD
    if (stream_) return stream_fill(dst, n, value);
    if (avx2_) return fill_avx2(dst, n, value);
#endif
    ::fill(dst, n, value);
  }

  void copy(int32_t* dst, const int32_t* src, int32_t n) const {
#ifdef TP_X86_SIMD
    if (stream_) return stream_copy(dst, src, n);
#endif
    std::memcpy(dst, src, sizeof(int32_t) * static_cast<size_t>(n));
  }

  // Non-temporal stores are weakly ordered: fence them before the caller (or another thread) reads the outputs.
  void finish() const {
#ifdef TP_X86_SIMD
    if (stream_) _mm_sfence();
#endif
  }

 private:
  bool avx2_ = false;
  bool stream_ = false;
};

}  // namespace

extern "C" {

const char* tp_version(void) { return TP_VERSION; }

const char* tp_status_string(int code) { return tp_status_message(code); }

const char* tp_abi(void) { return TP_ABI; }

int tp_plan_create(const int32_t* tokens, int64_t num_tokens, const int32_t* offsets, int64_t num_seqs,
                   tp_plan** plan_out, int64_t* num_nodes) {
  if (plan_out == nullptr || num_nodes == nullptr) return TP_ERR_ARG;
  *plan_out = nullptr;
  if (num_seqs < 0 || num_tokens < 0 || offsets == nullptr || (tokens == nullptr && num_tokens > 0)) {
    return TP_ERR_ARG;
  }
  // S + 1 offsets and every index must be an int32.
  if (num_seqs >= INT32_MAX || num_tokens > INT32_MAX) return TP_ERR_TOO_LARGE;
  const int32_t S = static_cast<int32_t>(num_seqs);
  if (offsets[0] != 0 || offsets[S] != num_tokens) return TP_ERR_OFFSETS;
  int32_t max_len = 0;
  for (int32_t i = 0; i < S; i++) {
    if (offsets[i + 1] < offsets[i]) return TP_ERR_OFFSETS;
    max_len = std::max(max_len, offsets[i + 1] - offsets[i]);
  }
  const int32_t path_cap = std::min(max_len, kPathTokens);

  // One allocation: the header, the two merge buffers' keys (2S int64), then their orders and LCPs, the runs (7S
  // int32) and the path.
  const size_t header = (sizeof(tp_plan) + 63) & ~size_t{63};
  const size_t count = static_cast<size_t>(S);
  char* block = static_cast<char*>(std::malloc(header + sizeof(int64_t) * 2 * count +
                                               sizeof(int32_t) * (7 * count + static_cast<size_t>(path_cap))));
  if (block == nullptr) return TP_ERR_ALLOC;
  tp_plan* plan = reinterpret_cast<tp_plan*>(block);
  int64_t* keys = reinterpret_cast<int64_t*>(block + header);
  int32_t* ints = reinterpret_cast<int32_t*>(keys + 2 * count);
  const Sorted a{ints, ints + count, keys}, b{ints + 2 * count, ints + 3 * count, keys + count};
  const Runs runs{ints + 4 * count, ints + 5 * count, ints + 6 * count};
  plan->tokens = tokens;
  plan->offsets = offsets;
  plan->num_seqs = S;
  const Sorted sorted = sort_sequences(tokens, offsets, S, a, b, runs);
  plan->order = sorted.order;
  plan->lcp = sorted.lcp;
  plan->spare = sorted.order == a.order ? b.order : a.order;  // order and lcp are adjacent: 2S int32
  plan->path = ints + 7 * count;
  plan->path_cap = path_cap;

  int64_t n = 0;
  for (int32_t k = 0; k < S; k++) {
    const int32_t s = plan->order[k];
    n += offsets[s + 1] - offsets[s] - plan->lcp[k];
  }
  plan->num_nodes = n;
  *num_nodes = n;
  *plan_out = plan;
  return TP_OK;
}

int tp_plan_layout(tp_plan* plan, int32_t* input_ids, int32_t* position_ids, int32_t* parent, int32_t* subtree_end,
                   int32_t* seq_positions) {
  if (plan == nullptr) return TP_ERR_ARG;
  const int32_t S = plan->num_seqs;
  const int32_t* __restrict tokens = plan->tokens;
  const int32_t* __restrict offsets = plan->offsets;
  const int32_t* __restrict order = plan->order;
  const int32_t* __restrict lcp = plan->lcp;
  if (offsets[S] > 0 && (input_ids == nullptr || position_ids == nullptr || parent == nullptr ||
                         subtree_end == nullptr || seq_positions == nullptr)) {
    return TP_ERR_ARG;
  }

  const Stores out(sizeof(int32_t) * (static_cast<size_t>(offsets[S]) + 4 * static_cast<size_t>(plan->num_nodes)));

  // The current sorted sequence's path, as segments of consecutive nodes: segment e starts at depth depth[e] and
  // packed position pos[e] and ends where segment e+1 starts (the last one at the sequence's length). A node's
  // subtree ends where the first later sequence that does not go through it starts adding nodes, so when sequence
  // k diverges at depth h, every open node at depth >= h gets subtree_end = the position of k's first new node.
  int32_t* __restrict depth = plan->spare;
  int32_t* __restrict pos = plan->spare + S;
  int32_t open = 0;
  int32_t next = 0, prev_len = 0;
  // Writes the positions of the path's depths [from, to) to dst[from, to), to <= the current sequence's length.
  const auto path_positions = [&](int32_t* dst, int32_t from, int32_t to, const Stores& stores) {
    for (int32_t e = 0; e < open && depth[e] < to; e++) {
      const int32_t lo = std::max(depth[e], from), hi = e + 1 < open ? std::min(depth[e + 1], to) : to;
      if (lo < hi) stores.iota(dst + lo, hi - lo, pos[e] + (lo - depth[e]));
    }
  };
  const Stores plain(0);
  int32_t* __restrict path = plan->path;
  int32_t path_valid = 0;  // path[0, path_valid) holds the previous sequence's first positions
  const auto close_from = [&](int32_t h, int32_t end) {
    int32_t hi = prev_len;
    while (open > 0 && depth[open - 1] >= h) {
      --open;
      out.fill(subtree_end + pos[open], hi - depth[open], end);
      hi = depth[open];
    }
    if (open > 0 && h < hi) out.fill(subtree_end + pos[open - 1] + (h - depth[open - 1]), hi - h, end);
  };

  for (int32_t k = 0; k < S; k++) {
    const int32_t s = order[k];
    const int32_t start = offsets[s], len = offsets[s + 1] - start, h = lcp[k];
    if (k + 1 < S) prefetch_fresh(tokens, offsets, order[k + 1], lcp[k + 1]);
    close_from(h, next);
    const int32_t fresh = len - h;
    if (fresh > 0) {
      out.copy(input_ids + next, tokens + start + h, fresh);
      out.iota(position_ids + next, fresh, h);
      parent[next] = h > 0 ? pos[open - 1] + (h - 1 - depth[open - 1]) : -1;
      out.iota(parent + next + 1, fresh - 1, next);
      depth[open] = h;
      pos[open++] = next;
      next += fresh;
    }
    // seq_positions: `path` keeps the positions of the path so far, so the shared prefix is already in place and
    // the sequence is one copy (streamed or not) of a buffer in cache.
    if (len <= plan->path_cap) {
      if (path_valid < h) path_positions(path, path_valid, h, plain);  // after a sequence too long for the buffer
      plain.iota(path + h, fresh, next - fresh);
      path_valid = len;
      if (len > 0) out.copy(seq_positions + start, path, len);  // seq_positions is null when M is 0
    } else {
      path_positions(seq_positions + start, 0, len, out);
      path_valid = std::min(path_valid, h);
    }
    prev_len = len;
  }
  close_from(0, next);
  out.finish();
  return TP_OK;
}

void tp_plan_free(tp_plan* plan) { std::free(plan); }

}  // extern "C"
