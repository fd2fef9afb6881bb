"""Brute-force mask references for the tests: the attention rule written out densely (O(N²)), sharing no code with
the C core's lowerings they check (treepack.flex)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from treepack.flex import SLICE_CAUSAL, BlockArrays


def dense_mask(subtree_end: np.ndarray, position_ids: Any = None, window: Optional[int] = None) -> np.ndarray:
    """bool [N, N], row = query: the reference every lowering is checked against (O(N²)); with ``window`` (and
    ``position_ids``) also ``position_ids[q] - position_ids[k] < window``."""
    se = np.asarray(subtree_end, dtype=np.int64)
    q = np.arange(len(se))[:, None]
    k = np.arange(len(se))[None, :]
    mask = (k <= q) & (q < se[None, :])
    if window is not None:
        pos = np.asarray(position_ids, dtype=np.int64)
        mask &= pos[:, None] - pos[None, :] < window
    return mask


def block_arrays_from_dense(mask: np.ndarray, block_size: int) -> BlockArrays:
    """What torch's ``create_block_mask`` derives from a dense mask: padding counts as masked, so only whole
    visible tiles are full; indices ascending, padded with 0 (torch pads with the other columns instead, which
    FlexAttention never reads)."""
    n = mask.shape[0]
    nb = -(-n // block_size)
    padded = np.zeros((nb * block_size, nb * block_size), dtype=bool)
    padded[:n, :n] = mask
    counts = padded.reshape(nb, block_size, nb, block_size).sum(axis=(1, 3))
    full = counts == block_size * block_size
    partial = (counts > 0) & ~full

    def ordered(sel: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        num = sel.sum(axis=1).astype(np.int32)
        idx = np.zeros((nb, nb), dtype=np.int32)
        for i in range(nb):
            cols = np.nonzero(sel[i])[0]
            idx[i, : len(cols)] = cols
        return num, idx

    return BlockArrays(block_size, *ordered(partial), *ordered(full))


def slices_to_dense(slices: np.ndarray, n: int) -> np.ndarray:
    """How many slices cover each pair, int [N, N]: 1 on visible pairs and 0 elsewhere for exact slices."""
    cover = np.zeros((n, n), dtype=np.int32)
    for qs, qe, ks, ke, kind in np.asarray(slices).reshape(-1, 5).tolist():
        block = np.ones((qe - qs, ke - ks), dtype=np.int32)
        if kind == SLICE_CAUSAL:
            block = np.tril(block)
        cover[qs:qe, ks:ke] += block
    return cover
