"""Tests of treepack.flex that need numpy only; the FlexAttention-vs-SDPA check is test_flex_gpu.py (torch, GPU).

Micro-batch files with masks are written by the TypeScript side (test/python-masks.test.ts passes their paths in
TREEPACK_MASK_FILES); without them only the file-independent tests run.
"""

from __future__ import annotations

import os
import unittest

import numpy as np
import treepack
from mask_reference import block_arrays_from_dense, dense_mask, random_forest, slices_to_dense
from treepack import TreepackError
from treepack.flex import block_arrays, block_arrays_from_tree, block_arrays_windowed, cu_seqlens, magi_slices, slices_from_tree
from treepack.loss import core_library

try:
    core_library()
    CORE_SKIP = ""
except TreepackError as e:  # E_BACKEND: the C core is not built here
    CORE_SKIP = str(e)


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


class TreeBuilders(unittest.TestCase):
    """The lowerings built in Python from the tree arrays (no --masks needed)."""

    def test_block_arrays_from_tree_equal_the_dense_derivation(self) -> None:
        rng = np.random.default_rng(3)
        for trial in range(60):
            par, se = random_forest(rng)
            np.testing.assert_array_equal(dense_mask(se), parent_dense(par))
            for B in (1, 2, 3, 8, 128):
                got, want = block_arrays_from_tree(se, B), block_arrays_from_dense(dense_mask(se), B)
                for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"trial {trial}, B = {B}: {name}")

    def test_windowed_block_arrays_equal_the_dense_derivation(self) -> None:
        # position_ids = depth plus a per-root offset; the window counts the query itself (transformers' convention).
        rng = np.random.default_rng(4)
        for trial in range(40):
            par, se = random_forest(rng)
            pos = np.zeros(len(par), dtype=np.int64)
            for p in range(len(par)):
                pos[p] = int(rng.integers(0, 5)) if par[p] < 0 else pos[par[p]] + 1
            rel = parent_dense(par)
            for W in (1, 2, 3, 6, 100):
                dense = rel & (pos[:, None] - pos[None, :] < W)
                np.testing.assert_array_equal(dense_mask(se, pos, W), dense)
                for B in (1, 2, 3, 8):
                    got, want = block_arrays_windowed(se, pos, W, B), block_arrays_from_dense(dense, B)
                    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                        np.testing.assert_array_equal(
                            getattr(got, name), getattr(want, name), err_msg=f"trial {trial}, W = {W}, B = {B}: {name}"
                        )
        for bad in (0, -1, 2.5, True, None):
            with self.assertRaises(treepack.TreepackError) as cm:
                block_arrays_windowed(np.array([1]), np.array([0]), bad, 1)
            self.assertEqual(cm.exception.field, "sliding_window")
        with self.assertRaises(treepack.TreepackError) as cm:
            block_arrays_windowed(np.array([2, 2]), np.array([0]), 3, 1)
        self.assertEqual(cm.exception.field, "position_ids")

    def test_cu_seqlens(self) -> None:
        np.testing.assert_array_equal(cu_seqlens(np.array([-1, 0, 1, -1, 3, -1])), [0, 3, 5, 6])
        np.testing.assert_array_equal(cu_seqlens(np.array([], dtype=np.int32)), [0])
        with self.assertRaises(treepack.TreepackError) as cm:
            cu_seqlens(np.array([-1, 0, 0]))
        self.assertEqual(cm.exception.field, "parent")

    def test_bad_tree_names_the_field(self) -> None:
        for se, field in ((np.array([1, 1]), "subtree_end"), (np.array([1.0]), "subtree_end")):
            with self.assertRaises(treepack.TreepackError) as cm:
                block_arrays_from_tree(se, 4)
            self.assertEqual(cm.exception.field, field)
        with self.assertRaises(treepack.TreepackError) as cm:
            block_arrays_from_tree(np.array([1]), 0)
        self.assertEqual(cm.exception.field, "block_size")


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

    def test_python_builders_equal_the_stored_lowerings(self) -> None:
        # What Python builds from subtree_end / parent is what the TypeScript side wrote, element for element.
        for path in os.environ["TREEPACK_MASK_FILES"].split(os.pathsep):
            mb = treepack.load(path)
            stored = block_arrays(mb)
            built = block_arrays_from_tree(mb.subtree_end, stored.block_size)
            for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                np.testing.assert_array_equal(getattr(built, name), getattr(stored, name), err_msg=f"{path}: {name}")
            if not CORE_SKIP:
                np.testing.assert_array_equal(slices_from_tree(mb.parent, mb.subtree_end), mb.extra["slices"], err_msg=path)


if __name__ == "__main__":
    unittest.main()
