/*
 * treepack C ABI, mask lowerings (docs/design.md §3, the TypeScript reference is src/mask): every lowering of the
 * attention rule "q attends to k iff k <= q < subtree_end[k]" from the tree arrays of a packed micro-batch.
 *
 * The core checks what keeps it memory-safe (TP_ERR_TREE: parent[p] in [-1, p), subtree_end[p] in (p, N];
 * TP_ERR_TOO_LARGE: N > INT32_MAX), as the CUDA twins do (native/cuda/treepack_cuda.h); that
 * subtree_end agrees with parent in a DFS preorder is the caller's check (src/mask/validate.ts), since a
 * lowering of an inconsistent tree is well defined, only meaningless. Outputs are caller-allocated.
 */
#ifndef TREEPACK_MASK_H
#define TREEPACK_MASK_H

#include <stdint.h>

#include "treepack.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Dense bool [n, n] as bytes (0/1), row q = query. Both trees' arrays are checked (the CPU reads parent, CUDA
 * subtree_end). */
TP_API int tp_mask_dense(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint8_t* out);

/* Packed bits [n, ceil(n/32)] uint32, row-major; bit k % 32 of word (q, k / 32) is pair (q, k). */
TP_API int tp_mask_bits(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint32_t* out);

/*
 * FlexAttention BlockMask for block size B >= 1, nb = ceil(n / B): kv_num[nb], kv_idx[nb * nb] (partial kv
 * blocks per query block, ascending), full_num[nb], full_idx[nb * nb] (full blocks likewise). Every output entry is
 * written, the 0 padding of each row included (as on CUDA), so outputs need not be zeroed. O(n + nb²).
 */
TP_API int tp_mask_blocks(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num, int32_t* kv_idx,
                          int32_t* full_num, int32_t* full_idx);

/*
 * Range slices int32 [K, 5]: (q_start, q_end, k_start, k_end, kind), kind 0 full, 1 causal. Writes K to *count;
 * when K > capacity (in slices) returns TP_ERR_CAPACITY and writes nothing else: call again with room for K.
 */
TP_API int tp_mask_slices(const int32_t* parent, const int32_t* subtree_end, int64_t n, int32_t* out, int64_t capacity,
                          int64_t* count);

/* cu_seqlens int32 [R + 1] for R roots; R is written to *count and capacity (in entries) must be >= R + 1, else
 * TP_ERR_CAPACITY. TP_ERR_SHARED when a node has more than one child. */
TP_API int tp_mask_cu_seqlens(const int32_t* parent, int64_t n, int32_t* out, int64_t capacity, int64_t* count);

#ifdef __cplusplus
}
#endif

#endif /* TREEPACK_MASK_H */
