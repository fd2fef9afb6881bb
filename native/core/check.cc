// The forest checker (check.h): one forward pass over the nodes, one backward pass that recomputes each node's
// subtree from parent, one pass over the occurrences.
#include <cstdlib>

#include "treepack.h"

namespace {

class Report {
 public:
  Report(int64_t* counts, tp_violation* examples, int32_t max_examples)
      : counts_(counts), examples_(examples), max_(max_examples) {
    for (int c = 0; c < TP_CHECK_COUNT; c++) counts_[c] = 0;
  }
  void Add(int kind, int64_t index, int64_t value, int64_t expected, int64_t seq = -1, int64_t t = -1) {
    const int64_t n = counts_[kind]++;
    if (n < max_) examples_[kind * max_ + n] = tp_violation{index, value, expected, seq, t};
  }

 private:
  int64_t* counts_;
  tp_violation* examples_;
  int64_t max_;
};

// A node's parent is valid when it is -1 or an earlier node: only such edges are followed.
inline bool ValidParent(int32_t q, int64_t p) { return q >= -1 && q < p; }

void CheckNodes(const int32_t* pos, const int32_t* parent, const int32_t* se, int64_t n, int64_t pad, int32_t* end,
                int32_t* size, Report& out) {
  for (int64_t p = 0; p < n; p++) {
    const int32_t q = parent[p];
    end[p] = static_cast<int32_t>(p + 1);
    size[p] = 1;
    if (!ValidParent(q, p)) {
      out.Add(TP_CHECK_PARENT, p, q, -1);
      continue;
    }
    const int64_t depth = q < 0 ? 0 : int64_t{pos[q]} + 1;
    if (pos[p] != depth) out.Add(TP_CHECK_DEPTH, p, pos[p], depth);
  }
  // Backward, children before parents: the end of the smallest interval holding each subtree, and its size. The
  // interval is exactly the subtree (what the attention rule k <= q < subtree_end[k] needs) iff the two agree.
  for (int64_t p = n - 1; p >= 0; p--) {
    const int32_t q = parent[p];
    if (q >= 0 && q < p) {
      if (end[p] > end[q]) end[q] = end[p];
      size[q] += size[p];
    }
  }
  for (int64_t p = 0; p < n; p++) {
    if (end[p] - p != size[p]) out.Add(TP_CHECK_PREORDER, p, end[p], size[p]);
    if (!(se[p] > p && se[p] <= n)) {
      out.Add(TP_CHECK_SUBTREE_RANGE, p, se[p], end[p]);
    } else if (se[p] != end[p]) {
      out.Add(TP_CHECK_SUBTREE_END, p, se[p], end[p]);
    }
  }
  for (int64_t p = n - pad; p < n; p++) {
    if (parent[p] != -1 || se[p] != p + 1) out.Add(TP_CHECK_PAD, p, parent[p], se[p]);
  }
}

bool CheckOffsets(const int32_t* off, int64_t S, int64_t M, Report& out) {
  bool ok = true;
  if (off[0] != 0) {
    out.Add(TP_CHECK_OFFSETS, 0, off[0], 0);
    ok = false;
  }
  for (int64_t i = 0; i < S; i++) {
    if (off[i + 1] < off[i]) {
      out.Add(TP_CHECK_OFFSETS, i + 1, off[i + 1], off[i]);
      ok = false;
    }
  }
  if (off[S] != M) {
    out.Add(TP_CHECK_OFFSETS, S, off[S], M);
    ok = false;
  }
  return ok;
}

void CheckOccurrences(const int32_t* pos, const int32_t* parent, int64_t n, int64_t pad, const int32_t* off, int64_t S,
                      const int32_t* sp, const uint8_t* mask, const int32_t* turns, Report& out) {
  for (int64_t i = 0; i < S; i++) {
    for (int64_t k = off[i]; k < off[i + 1]; k++) {
      const int64_t t = k - off[i], p = sp[k];
      if (t == 0 && mask != nullptr && mask[k] != 0) out.Add(TP_CHECK_LOSS_MASK, k, mask[k], 0, i, t);
      if (t > 0 && turns != nullptr && turns[k] < turns[k - 1])
        out.Add(TP_CHECK_TURN_ORDER, k, turns[k], turns[k - 1], i, t);
      if (!(p >= 0 && p < n)) {
        out.Add(TP_CHECK_POSITION_RANGE, k, p, -1, i, t);
        continue;
      }
      if (p >= n - pad) out.Add(TP_CHECK_POSITION_PAD, k, p, -1, i, t);
      const int64_t want = t == 0 ? -1 : sp[k - 1];
      if (parent[p] != want) out.Add(TP_CHECK_PATH, k, parent[p], want, i, t);
      if (pos[p] != t) out.Add(TP_CHECK_POSITION_T, k, pos[p], t, i, t);
    }
  }
}

}  // namespace

extern "C" {

int tp_forest_check(const int32_t* position_ids, const int32_t* parent, const int32_t* subtree_end, int64_t num_nodes,
                    int64_t num_pad, const int32_t* seq_offsets, int64_t num_seqs, const int32_t* seq_positions,
                    const uint8_t* loss_mask, const int32_t* turn_ids, int64_t num_occ, int32_t max_examples,
                    int64_t* counts, tp_violation* examples) {
  const int64_t n = num_nodes, S = num_seqs, M = num_occ;
  if (n < 0 || S < 0 || M < 0 || num_pad < 0 || max_examples < 0 || counts == nullptr || seq_offsets == nullptr ||
      (max_examples > 0 && examples == nullptr) ||
      (n > 0 && (position_ids == nullptr || parent == nullptr || subtree_end == nullptr)) ||
      (M > 0 && seq_positions == nullptr)) {
    return TP_ERR_ARG;
  }
  if (n > INT32_MAX || M > INT32_MAX || S >= INT32_MAX) return TP_ERR_TOO_LARGE;
  int32_t* scratch = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * static_cast<size_t>(2 * n + 1)));
  if (scratch == nullptr) return TP_ERR_ALLOC;
  Report out(counts, examples, max_examples);
  const int64_t pad = num_pad < n ? num_pad : n;
  CheckNodes(position_ids, parent, subtree_end, n, pad, scratch, scratch + n, out);
  std::free(scratch);
  if (CheckOffsets(seq_offsets, S, M, out)) {
    CheckOccurrences(position_ids, parent, n, pad, seq_offsets, S, seq_positions, loss_mask, turn_ids, out);
  }
  return TP_OK;
}

}  // extern "C"
