/*
 * treepack C ABI, the forest checker (included by treepack.h): docs/design.md §7 invariants 1, 2 and 4 of a packed
 * micro-batch, and the padding extension (num_pad_tokens), for arrays of any origin. Nothing is trusted: every
 * index is range-checked before use. The TypeScript checker is src/pack/invariants.ts; the Python one
 * (treepack.check_invariants) formats this function's output.
 */
#ifndef TREEPACK_CHECK_H
#define TREEPACK_CHECK_H

#include <stdint.h>

#include "treepack.h" /* TP_API, tp_violation and the TP_CHECK_* kinds (abi.h) */

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Checks the node arrays position_ids, parent, subtree_end [num_nodes], the last num_pad of them padding, and the
 * occurrences: seq_offsets [num_seqs + 1], seq_positions [num_occ], loss_mask [num_occ] and turn_ids [num_occ] (each
 * NULL: not checked; turn_ids must never decrease along a sequence).
 * counts [TP_CHECK_COUNT] receives the number of violations of each kind; examples [TP_CHECK_COUNT * max_examples]
 * the first max_examples of kind c at c * max_examples (max_examples may be 0, examples then NULL). The occurrence
 * checks run only when seq_offsets is CSR over num_occ. O(N + M). Returns TP_ERR_ARG for a missing array or a
 * negative count, TP_ERR_TOO_LARGE past int32, TP_ERR_ALLOC; a forest that breaks every invariant is still TP_OK.
 */
TP_API int tp_forest_check(const int32_t* position_ids, const int32_t* parent, const int32_t* subtree_end,
                           int64_t num_nodes, int64_t num_pad, const int32_t* seq_offsets, int64_t num_seqs,
                           const int32_t* seq_positions, const uint8_t* loss_mask, const int32_t* turn_ids,
                           int64_t num_occ, int32_t max_examples, int64_t* counts, tp_violation* examples);

#ifdef __cplusplus
}
#endif

#endif /* TREEPACK_CHECK_H */
