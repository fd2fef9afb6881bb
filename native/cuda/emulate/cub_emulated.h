// Stand-ins for the two CUB device algorithms native/cuda/loss.cu calls, with CUB's calling convention (a first call
// with no temporary storage sizes it; a buffer smaller than asked is cudaErrorInvalidValue): DeviceRadixSort::
// SortPairs as a stable sort on the key bits [begin_bit, end_bit), signed keys ordered as CUB orders them, and
// DeviceScan::ExclusiveSum as a sequential scan. They check the calls, not CUB itself (CONTRIBUTING.md).
#ifndef TREEPACK_CUDA_EMULATE_CUB_H
#define TREEPACK_CUDA_EMULATE_CUB_H

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <type_traits>

namespace cub {

struct DeviceRadixSort {
  template <typename K, typename V, typename NumItems>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out, const V* values_in,
                               V* values_out, NumItems num_items, int begin_bit = 0, int end_bit = sizeof(K) * 8,
                               cudaStream_t = nullptr) {
    static_assert(std::is_integral<K>::value, "SortPairs: integer keys only");
    using U = std::make_unsigned_t<K>;
    const size_t n = num_items > 0 ? static_cast<size_t>(num_items) : 0;
    // The permutation lives in the caller's temporary storage, so an undersized buffer is an overflow that the
    // AddressSanitizer build reports.
    const size_t need = sizeof(uint32_t) * (n > 0 ? n : 1);
    if (temp == nullptr) {
      temp_bytes = need;
      return cudaSuccess;
    }
    if (temp_bytes < need || begin_bit < 0 || end_bit > static_cast<int>(sizeof(K) * 8) || begin_bit >= end_bit) {
      return cudaErrorInvalidValue;
    }
    // CUB's bit-twiddle: the sign bit flipped, so signed keys sort as numbers; then only the bits asked for.
    const U flip = std::is_signed<K>::value ? U(U(1) << (sizeof(K) * 8 - 1)) : U(0);
    const int width = end_bit - begin_bit;
    const U field = width == static_cast<int>(sizeof(U) * 8) ? U(~U(0)) : U((U(1) << width) - 1);
    auto digit = [&](uint32_t i) { return U((U(keys_in[i]) ^ flip) >> begin_bit) & field; };
    uint32_t* perm = static_cast<uint32_t*>(temp);
    for (size_t i = 0; i < n; i++) perm[i] = static_cast<uint32_t>(i);
    std::stable_sort(perm, perm + n, [&](uint32_t a, uint32_t b) { return digit(a) < digit(b); });
    for (size_t i = 0; i < n; i++) {
      keys_out[i] = keys_in[perm[i]];
      values_out[i] = values_in[perm[i]];
    }
    return cudaSuccess;
  }
};

struct DeviceScan {
  template <typename In, typename Out, typename NumItems>
  static cudaError_t ExclusiveSum(void* temp, size_t& temp_bytes, In in, Out out, NumItems num_items,
                                  cudaStream_t = nullptr) {
    if (temp == nullptr) {
      temp_bytes = 1;
      return cudaSuccess;
    }
    if (temp_bytes < 1) return cudaErrorInvalidValue;
    using T = typename std::iterator_traits<In>::value_type;
    T sum = T();
    for (NumItems i = 0; i < num_items; i++) {
      const T x = in[i];
      out[i] = sum;
      sum = sum + x;
    }
    return cudaSuccess;
  }
};

}  // namespace cub

#endif  // TREEPACK_CUDA_EMULATE_CUB_H
