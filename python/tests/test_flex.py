"""Tests of treepack.flex that need numpy only; the FlexAttention-vs-SDPA check is test_flex_gpu.py (torch, GPU).

Micro-batch files with masks are written by the TypeScript side (test/python.test.ts passes their paths in
TREEPACK_MASK_FILES); without them only the file-independent tests run.
"""

from __future__ import annotations

import os
import unittest

import numpy as np

import treepack
from treepack.flex import block_arrays, block_arrays_from_dense, dense_mask, magi_slices, slices_to_dense


def parent_dense(parent: np.ndarray) -> np.ndarray:
    """The ancestor relation walked through parent pointers: independent of subtree_end."""
    n = len(parent)
    mask = np.zeros((n, n), dtype=bool)
    for q in range(n):
        x = q
        while x >= 0:
            mask[q, x] = True
            x = parent[x]
    return mask


class DenseReference(unittest.TestCase):
    def test_dense_mask_is_the_ancestor_relation(self) -> None:
        # 0 → 1 → {2, 3 → 4}, then a second root 5.
        parent = np.array([-1, 0, 1, 1, 3, -1], dtype=np.int32)
        subtree_end = np.array([5, 5, 3, 5, 5, 6], dtype=np.int32)
        np.testing.assert_array_equal(dense_mask(subtree_end), parent_dense(parent))

    def test_block_arrays_from_dense_marks_cut_tiles_partial(self) -> None:
        mask = np.tril(np.ones((5, 5), dtype=bool))
        b = block_arrays_from_dense(mask, 2)
        # Tiles: (1,0) whole and visible → full; (2,0), (2,1) cut by N = 5 → partial; diagonals partial.
        np.testing.assert_array_equal(b.full_kv_num_blocks, [0, 1, 0])
        np.testing.assert_array_equal(b.kv_num_blocks, [1, 1, 3])
        np.testing.assert_array_equal(b.kv_indices[2], [0, 1, 2])


@unittest.skipUnless(os.environ.get("TREEPACK_MASK_FILES"), "no micro-batch files with masks given (TREEPACK_MASK_FILES)")
class StoredMasks(unittest.TestCase):
    def test_every_file_agrees_with_the_dense_rule(self) -> None:
        for path in os.environ["TREEPACK_MASK_FILES"].split(os.pathsep):
            mb = treepack.load(path)
            dense = parent_dense(mb.parent)
            got = block_arrays(mb)
            want = block_arrays_from_dense(dense, got.block_size)
            for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"{path}: {name}")
            q_ranges, k_ranges, types = magi_slices(mb)
            slices = np.array([q + k + [t] for q, k, t in zip(q_ranges, k_ranges, types)], dtype=np.int32).reshape(-1, 5)
            np.testing.assert_array_equal(slices_to_dense(slices, len(mb.parent)), dense.astype(np.int32), err_msg=path)


if __name__ == "__main__":
    unittest.main()
