// The attention rule and the block-mask rule of src/mask, shared by the C++ core (mask.cc) and the CUDA kernels
// (native/cuda/mask.cu) so that both lower exactly what the TypeScript reference does; and the argument checks both
// C ABIs make before touching a tree.
#ifndef TREEPACK_MASK_MATH_H
#define TREEPACK_MASK_MATH_H

#include <stdint.h>

#include "abi.h"
#include "inline.h"

namespace treepack {
namespace mask {

// q may attend to k iff k is q or an ancestor of q: k <= q < subtree_end[k].
TP_HD bool Visible(const int32_t* subtree_end, int64_t q, int64_t k) { return k <= q && q < subtree_end[k]; }

// Kv block j, whose keys' subtree_end lie in [lo, hi], is full for the query blocks i with j < i < full_end and
// partial for full_end <= i < any_end (src/mask/blocks.ts explains why); the diagonal block is full only for B = 1.
struct BlockEnds {
  int64_t full_end, any_end;
};

TP_HD BlockEnds BlockEndsOf(int64_t lo, int64_t hi, int64_t B, int64_t nb) {
  const int64_t any = (hi + B - 1) / B;
  return BlockEnds{lo / B, any < nb ? any : nb};
}

TP_HD bool DiagonalFull(int64_t B) { return B == 1; }

// Node p's entries keep every kernel in bounds: parent[p] in [-1, p), subtree_end[p] in (p, n].
TP_HD bool NodeInRange(const int32_t* parent, const int32_t* subtree_end, int64_t p, int64_t n) {
  return (parent == nullptr || (parent[p] >= -1 && parent[p] < p)) &&
         (subtree_end == nullptr || (subtree_end[p] > p && subtree_end[p] <= n));
}

// The status of a call on a tree of n nodes: the arrays it needs present, n in int32 (positions are int32), every
// node in range. O(n) on the host.
inline int CheckTree(const int32_t* parent, const int32_t* subtree_end, int64_t n, bool need_parent, bool need_end) {
  if (n < 0 || (n > 0 && ((need_parent && parent == nullptr) || (need_end && subtree_end == nullptr)))) {
    return TP_ERR_ARG;
  }
  if (n > INT32_MAX) return TP_ERR_TOO_LARGE;
  for (int64_t p = 0; p < n; p++) {
    if (!NodeInRange(need_parent ? parent : nullptr, need_end ? subtree_end : nullptr, p, n)) return TP_ERR_TREE;
  }
  return TP_OK;
}

}  // namespace mask
}  // namespace treepack

#endif  // TREEPACK_MASK_MATH_H
