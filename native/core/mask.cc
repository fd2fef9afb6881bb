// Mask lowerings on the CPU: the C++ twins of src/mask/{dense,blocks,slices,cuseqlens}.ts (see there for why each
// algorithm is what it is); results equal the TypeScript reference element for element.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "mask_math.h"
#include "treepack.h"

namespace tmask = treepack::mask;

namespace {

using tmask::CheckTree;

// Row q of a row-major [n, width] mask is row parent[q] plus q's own bit.
template <typename T, typename SetSelf>
void RowsFromParent(const int32_t* parent, int64_t n, int64_t width, T* out, SetSelf set_self) {
  for (int64_t q = 0; q < n; q++) {
    T* row = out + q * width;
    if (parent[q] >= 0) {
      std::memcpy(row, out + parent[q] * width, sizeof(T) * width);
    } else {
      std::memset(row, 0, sizeof(T) * width);
    }
    set_self(row, q);
  }
}

// The core builds without C++ exceptions (node-gyp's default): scratch memory is malloc'd and checked.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Scratch = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
Scratch<T> Allocate(int64_t n) {
  return Scratch<T>(static_cast<T*>(std::malloc(sizeof(T) * static_cast<size_t>(n > 0 ? n : 1))));
}

// Int32 rows of 5 that grow by doubling.
class SliceList {
 public:
  bool Push(int32_t qs, int32_t qe, int32_t ks, int32_t ke, int32_t kind) {
    if (5 * (count_ + 1) > capacity_) {
      const int64_t grown = capacity_ ? 2 * capacity_ : 5 * 64;
      void* p = std::realloc(data_.get(), sizeof(int32_t) * static_cast<size_t>(grown));
      if (p == nullptr) return false;
      data_.release();
      data_.reset(static_cast<int32_t*>(p));
      capacity_ = grown;
    }
    int32_t* row = data_.get() + 5 * count_++;
    row[0] = qs;
    row[1] = qe;
    row[2] = ks;
    row[3] = ke;
    row[4] = kind;
    return true;
  }
  int32_t* Row(int64_t s) { return data_.get() + 5 * s; }
  int64_t count() const { return count_; }

 private:
  Scratch<int32_t> data_;
  int64_t capacity_ = 0, count_ = 0;
};

}  // namespace

extern "C" {

int tp_mask_dense(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint8_t* out) {
  int rc = CheckTree(parent, subtree_end, n, true, true);
  if (rc != TP_OK) return rc;
  if (n > 0 && out == nullptr) return TP_ERR_ARG;
  RowsFromParent(parent, n, n, out, [](uint8_t* row, int64_t q) { row[q] = 1; });
  return TP_OK;
}

int tp_mask_bits(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint32_t* out) {
  int rc = CheckTree(parent, subtree_end, n, true, true);
  if (rc != TP_OK) return rc;
  if (n > 0 && out == nullptr) return TP_ERR_ARG;
  RowsFromParent(parent, n, (n + 31) / 32, out, [](uint32_t* row, int64_t q) { row[q >> 5] |= 1u << (q & 31); });
  return TP_OK;
}

int tp_mask_blocks(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num, int32_t* kv_idx,
                   int32_t* full_num, int32_t* full_idx) {
  int rc = CheckTree(nullptr, subtree_end, n, false, true);
  if (rc != TP_OK) return rc;
  if (block_size < 1) return TP_ERR_ARG;
  const int64_t B = block_size, nb = (n + B - 1) / B;
  if (nb > 0 && (kv_num == nullptr || kv_idx == nullptr || full_num == nullptr || full_idx == nullptr)) {
    return TP_ERR_ARG;
  }
  if (nb == 0) return TP_OK;
  std::memset(kv_num, 0, sizeof(int32_t) * static_cast<size_t>(nb));
  std::memset(full_num, 0, sizeof(int32_t) * static_cast<size_t>(nb));
  // Column by column: kv block j is full for query blocks (j, full_end) and partial for [.., any_end), so only
  // listed entries are visited, and ascending j keeps every row ascending.
  for (int64_t j = 0; j < nb; j++) {
    int32_t lo = INT32_MAX, hi = 0;
    for (int64_t k = j * B, end = std::min(n, k + B); k < end; k++) {
      lo = std::min(lo, subtree_end[k]);
      hi = std::max(hi, subtree_end[k]);
    }
    const int32_t jj = static_cast<int32_t>(j);
    if (tmask::DiagonalFull(B)) {
      full_idx[j * nb + full_num[j]++] = jj;
    } else {
      kv_idx[j * nb + kv_num[j]++] = jj;
    }
    const tmask::BlockEnds ends = tmask::BlockEndsOf(lo, hi, B, nb);
    int64_t i = j + 1;
    for (; i < ends.full_end; i++) full_idx[i * nb + full_num[i]++] = jj;
    for (; i < ends.any_end; i++) kv_idx[i * nb + kv_num[i]++] = jj;
  }
  // The padding past each row's count is 0, written here as tp_cuda_mask_blocks writes it: outputs need no zeroing.
  for (int64_t i = 0; i < nb; i++) {
    std::memset(kv_idx + i * nb + kv_num[i], 0, sizeof(int32_t) * static_cast<size_t>(nb - kv_num[i]));
    std::memset(full_idx + i * nb + full_num[i], 0, sizeof(int32_t) * static_cast<size_t>(nb - full_num[i]));
  }
  return TP_OK;
}

int tp_mask_slices(const int32_t* parent, const int32_t* se, int64_t n, int32_t* out, int64_t capacity,
                   int64_t* count) {
  int rc = CheckTree(parent, se, n, true, true);
  if (rc != TP_OK) return rc;
  if (count == nullptr || capacity < 0 || (capacity > 0 && out == nullptr)) return TP_ERR_ARG;
  Scratch<int32_t> run_start = Allocate<int32_t>(n), run_end = Allocate<int32_t>(n);
  Scratch<int32_t> range_start = Allocate<int32_t>(n), range_end = Allocate<int32_t>(n);
  Scratch<int64_t> range_slice = Allocate<int64_t>(n);
  if (!run_start || !run_end || !range_start || !range_end || !range_slice) return TP_ERR_ALLOC;
  SliceList slices;
  int64_t runs = 0, ranges = 0;
  for (int64_t a = 0; a < n;) {
    int64_t b = a + 1;
    while (b < n && parent[b] == b - 1 && se[b] == se[b - 1]) b++;
    const int32_t x = parent[a];
    while (runs > 0 && !(run_start[runs - 1] <= x && x < run_end[runs - 1])) {
      const int32_t s = run_start[--runs];
      if (range_start[ranges - 1] == s) {
        ranges--;
      } else {
        range_end[ranges - 1] = s;
      }
    }
    const int32_t qs = static_cast<int32_t>(a), qe = static_cast<int32_t>(b);
    for (int64_t g = 0; g < ranges; g++) {
      const int64_t s = range_slice[g];
      int32_t* row = s >= 0 ? slices.Row(s) : nullptr;
      if (row != nullptr && row[1] == qs && row[2] == range_start[g] && row[3] == range_end[g]) {
        row[1] = qe;
      } else {
        range_slice[g] = slices.count();
        if (!slices.Push(qs, qe, range_start[g], range_end[g], 0)) return TP_ERR_ALLOC;
      }
    }
    if (!slices.Push(qs, qe, qs, qe, 1)) return TP_ERR_ALLOC;
    run_start[runs] = qs;
    run_end[runs++] = qe;
    if (ranges > 0 && range_end[ranges - 1] == qs) {
      range_end[ranges - 1] = qe;
    } else {
      range_start[ranges] = qs;
      range_end[ranges] = qe;
      range_slice[ranges++] = -1;
    }
    a = b;
  }
  const int64_t k = slices.count();
  *count = k;
  if (k > capacity) return TP_ERR_CAPACITY;
  if (k > 0) std::memcpy(out, slices.Row(0), sizeof(int32_t) * 5 * static_cast<size_t>(k));
  return TP_OK;
}

int tp_mask_cu_seqlens(const int32_t* parent, int64_t n, int32_t* out, int64_t capacity, int64_t* count) {
  int rc = CheckTree(parent, nullptr, n, true, false);
  if (rc != TP_OK) return rc;
  if (count == nullptr || capacity < 0 || (capacity > 0 && out == nullptr)) return TP_ERR_ARG;
  int64_t roots = 0;
  for (int64_t p = 0; p < n; p++) {
    if (parent[p] >= 0 && parent[p] != p - 1) return TP_ERR_SHARED;
    if (parent[p] < 0) roots++;
  }
  *count = roots;
  if (roots + 1 > capacity) return TP_ERR_CAPACITY;
  int64_t r = 0;
  out[0] = 0;
  for (int64_t p = 1; p < n; p++) {
    if (parent[p] < 0) out[++r] = static_cast<int32_t>(p);
  }
  if (n > 0) out[roots] = static_cast<int32_t>(n);
  return TP_OK;
}

}  // extern "C"
