"""Brute-force mask references for the tests: the attention rule written out densely (O(N²)), sharing no code with
the C core's lowerings they check (treepack.flex)."""

from __future__ import annotations

from typing import Any

import numpy as np
from treepack.flex import SLICE_CAUSAL, BlockArrays


def dense_mask(subtree_end: np.ndarray, position_ids: Any = None, window: int | None = None, q_start: int = 0) -> np.ndarray:
    """bool [N - q_start, N], row = query q_start + r: the reference every lowering is checked against (O(N²)); with
    ``window`` (and ``position_ids``) also ``position_ids[q] - position_ids[k] < window``."""
    se = np.asarray(subtree_end, dtype=np.int64)
    q = np.arange(q_start, len(se))[:, None]
    k = np.arange(len(se))[None, :]
    mask = (k <= q) & (q < se[None, :])
    if window is not None:
        pos = np.asarray(position_ids, dtype=np.int64)
        mask &= pos[q] - pos[None, :] < window
    return mask


def block_arrays_from_dense(mask: np.ndarray, block_size: int) -> BlockArrays:
    """What torch's ``create_block_mask`` derives from a dense mask, bool [R, N] (row = query, its first row the first
    row of query block 0: R < N for rows [N - R, N)): padding counts as masked, so only whole visible tiles are full;
    indices ascending, padded with 0 (torch pads with the other columns instead, which FlexAttention never reads)."""
    r, n = mask.shape
    nq, nkv = -(-r // block_size), -(-n // block_size)
    padded = np.zeros((nq * block_size, nkv * block_size), dtype=bool)
    padded[:r, :n] = mask
    counts = padded.reshape(nq, block_size, nkv, block_size).sum(axis=(1, 3))
    full = counts == block_size * block_size
    partial = (counts > 0) & ~full

    def ordered(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        num = sel.sum(axis=1).astype(np.int32)
        idx = np.zeros((nq, nkv), dtype=np.int32)
        for i in range(nq):
            cols = np.nonzero(sel[i])[0]
            idx[i, : len(cols)] = cols
        return num, idx

    return BlockArrays(block_size, *ordered(partial), *ordered(full))


def random_forest(rng: np.random.Generator, max_nodes: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """(parent, subtree_end) of a random preorder forest of fewer than ``max_nodes`` nodes."""
    n = int(rng.integers(0, max_nodes))
    parent = np.array([-1 if p == 0 or rng.random() < 0.15 else int(rng.integers(0, p)) for p in range(n)], dtype=np.int64)
    # A preorder needs each child after its parent's earlier subtrees: rebuild one by DFS.
    children: list[list[int]] = [[] for _ in range(n)]
    for p in range(n):
        if parent[p] >= 0:
            children[parent[p]].append(p)
    order, stack = [], [p for p in reversed(range(n)) if parent[p] < 0]
    while stack:
        p = stack.pop()
        order.append(p)
        stack.extend(reversed(children[p]))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    par = np.array([-1 if parent[p] < 0 else rank[parent[p]] for p in order], dtype=np.int64)
    size = np.ones(n, dtype=np.int64)
    for p in reversed(range(n)):
        if par[p] >= 0:
            size[par[p]] += size[p]
    return par, np.arange(n) + size


def slices_to_dense(slices: np.ndarray, n: int) -> np.ndarray:
    """How many slices cover each pair, int [N, N]: 1 on visible pairs and 0 elsewhere for exact slices."""
    cover = np.zeros((n, n), dtype=np.int32)
    for qs, qe, ks, ke, kind in np.asarray(slices).reshape(-1, 5).tolist():
        block = np.ones((qe - qs, ke - ks), dtype=np.int32)
        if kind == SLICE_CAUSAL:
            block = np.tril(block)
        cover[qs:qe, ks:ke] += block
    return cover
