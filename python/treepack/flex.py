"""Attention masks of a packed micro-batch for trainers: torch FlexAttention and MagiAttention.

The rule (docs/design.md §3): query q attends to key k iff ``k <= q < subtree_end[k]``; a sliding-window layer also
needs ``position_ids[q] - position_ids[k] < window`` (§8; ``block_arrays_windowed``, ``tree_mask_mod``). ``treepack pack
--masks block:128,slices`` stores its lowerings in the micro-batch file (docs/concepts/prefix-trees.md, "Lowerings of
the rule"; tensor names in docs/reference/format.md):

    >>> import torch, treepack
    >>> from torch.nn.attention.flex_attention import flex_attention
    >>> mb = treepack.load(treepack.list_microbatches("packed")[0])   # packed with --masks block:128,slices
    >>> block_mask = flex_block_mask(mb, device="cpu")             # torch BlockMask, no N² work ("cuda" on a GPU)
    >>> q = k = v = torch.randn(1, 2, 10, 8)                       # q, k, v: [1, H, N, D]
    >>> out = flex_attention(q, k, v, block_mask=block_mask)
    >>> i, subtree_end = torch.arange(10), torch.as_tensor(mb.subtree_end)
    >>> rule = (i[None, :] <= i[:, None]) & (i[:, None] < subtree_end[None, :])   # k <= q < subtree_end[k]
    >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rule), atol=1e-5)
    True
    >>> q_ranges, k_ranges, types = magi_slices(mb)                # MagiAttention's attn ranges and type map
    >>> q_ranges, k_ranges, types                                  # nodes: a chain [0, 4), branches [4, 7), [7, 10)
    ([[0, 4], [4, 10], [4, 7], [7, 10]], [[0, 4], [0, 4], [4, 7], [7, 10]], [1, 0, 1, 1])

torch is imported only inside the functions that need it, so the numpy parts work without it. The lowerings built
here from the tree arrays are the C core's (``tp_mask_*`` in libtreepack_core.so, the cpu backend's code).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, NamedTuple

import numpy as np

from . import _abi, _native
from .errors import TreepackError
from .microbatch import MicroBatch

BLOCK_TENSORS = ("block_kv_num_blocks", "block_kv_indices", "block_full_kv_num_blocks", "block_full_kv_indices")
SLICE_FULL, SLICE_CAUSAL = 0, 1


class BlockArrays(NamedTuple):
    """FlexAttention's kv-block layout for one sequence: [nb] counts and [nb, nb] ascending indices, padded."""

    block_size: int
    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray
    full_kv_num_blocks: np.ndarray
    full_kv_indices: np.ndarray


def _fail(field: str, message: str) -> TreepackError:
    return TreepackError("E_INPUT", message, field=field)


def block_arrays(mb: MicroBatch) -> BlockArrays:
    """The block mask stored in a micro-batch (``--masks block:B``), with its shapes checked."""
    missing = [name for name in BLOCK_TENSORS if name not in mb.extra]
    if missing:
        raise _fail(missing[0], "no block mask in this micro-batch (pack it with --masks block:128)")
    size = mb.meta.get("block_size")
    if not isinstance(size, str) or not size.isdigit() or int(size) < 1:
        raise _fail("block_size", f"expected a positive integer in the metadata, got {size!r}")
    block_size = int(size)
    n = len(mb.subtree_end)
    nb = -(-n // block_size)
    arrays = [np.asarray(mb.extra[name]) for name in BLOCK_TENSORS]
    for name, a, shape in zip(BLOCK_TENSORS, arrays, ((nb,), (nb, nb), (nb,), (nb, nb))):
        if a.dtype != np.int32 or a.shape != shape:
            raise _fail(name, f"expected int32 {list(shape)} for N = {n}, block_size = {block_size}, got {a.dtype} {list(a.shape)}")
    return BlockArrays(block_size, *arrays)


def _tree_array(name: str, a: Any) -> np.ndarray:
    """A 1-D integer array as the C ABI's int32 (the core checks the values and says TP_ERR_TREE)."""
    arr = np.asarray(a)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise _fail(name, f"expected a 1-D integer array, got {arr.dtype} {list(arr.shape)}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def block_arrays_from_tree(subtree_end: Any, block_size: int = 128) -> BlockArrays:
    """The block mask of ``--masks block:B``, built from ``subtree_end`` by the C core (``tp_mask_blocks``, O(N + nb²)),
    equal element for element to the TypeScript lowering (src/mask/blocks.ts): partial and full kv blocks per query
    block, indices ascending, 0-padded.

        >>> import treepack
        >>> mb = treepack.pack_sequences([[2, 3, 4, 5, 6, 7, 1], [2, 3, 4, 5, 8, 9, 1]])   # a chain of 4, branches of 3
        >>> arrays = block_arrays_from_tree(mb.subtree_end, 4)     # query blocks [0, 4), [4, 8), [8, 10)
        >>> arrays.kv_num_blocks.tolist(), arrays.kv_indices.tolist()            # partial kv blocks per query block
        ([1, 1, 3], [[0, 0, 0], [1, 0, 0], [0, 1, 2]])
        >>> arrays.full_kv_num_blocks.tolist(), arrays.full_kv_indices[1].tolist()   # nodes 4-7 see all of 0-3
        ([0, 1, 0], [0, 0, 0])
    """
    if not (isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool) and 1 <= block_size < 2**31):
        raise _fail("block_size", f"expected an integer >= 1, got {block_size!r}")
    se = _tree_array("subtree_end", subtree_end)
    B, n = int(block_size), len(se)
    nb = -(-n // B)
    kv_num, full_num = np.zeros(nb, dtype=np.int32), np.zeros(nb, dtype=np.int32)
    kv_idx, full_idx = np.zeros((nb, nb), dtype=np.int32), np.zeros((nb, nb), dtype=np.int32)
    a = _native.pointer
    _native.check(
        _native.core().tp_mask_blocks(a(se), n, B, a(kv_num), a(kv_idx), a(full_num), a(full_idx)), "tp_mask_blocks", "subtree_end"
    )
    return BlockArrays(B, kv_num, kv_idx, full_num, full_idx)


def _layout(rows: np.ndarray, cols: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """FlexAttention's (counts [nb], indices [nb, nb]) of the tiles (rows[t], cols[t]): ascending, 0-padded."""
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    num = np.bincount(rows, minlength=nb).astype(np.int32)
    slot = np.arange(len(rows)) - np.repeat(np.cumsum(num) - num, num)
    idx = np.zeros((nb, nb), dtype=np.int32)
    idx[rows, slot] = cols
    return num, idx


def check_window(window: Any) -> int:
    """A sliding window as Hugging Face configs give it (``config.sliding_window``): an integer >= 1, the number of
    positions a query sees counting itself (``position_ids[q] - position_ids[k] < window``)."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise _fail("sliding_window", f"expected an integer >= 1, got {window!r}")
    return int(window)


def _position_ids(position_ids: Any, n: int) -> np.ndarray:
    pos = np.asarray(position_ids)
    if pos.shape != (n,) or pos.dtype.kind not in "iu":
        raise _fail("position_ids", f"expected a 1-D integer array of N = {n} elements, got {pos.dtype} {list(pos.shape)}")
    return pos.astype(np.int64)


# Tiles per numpy step of block_arrays_windowed: B² bools each, so at B = 128 about 64 MB of temporaries per step.
_WINDOW_STEP_PAIRS = 1 << 22


def block_arrays_windowed(subtree_end: Any, position_ids: Any, window: int, block_size: int = 128) -> BlockArrays:
    """The block mask of the tree rule with a sliding window (k an ancestor-or-self of q and ``position_ids[q] -
    position_ids[k] < window``), equal to ``block_arrays_from_dense`` of ``dense_mask(subtree_end, position_ids,
    window)``: tiles wholly outside the window are dropped, so the listed work is O(N · window) on a chain.

    The tree's listed tiles are the candidates: those whose least query position minus greatest key position reaches
    the window are dropped unseen, the tree's full tiles whose greatest difference stays inside it are full unseen,
    and the rest are classified exactly pair by pair (O(B²) each, in steps)."""
    W = check_window(window)
    se = _tree_array("subtree_end", subtree_end)
    n = len(se)
    pos = _position_ids(position_ids, n)
    tree = block_arrays_from_tree(se, block_size)
    B, nb = tree.block_size, len(tree.kv_num_blocks)
    slots = np.arange(nb)[None, :]
    rows, cols = [], []
    for num, idx in ((tree.kv_num_blocks, tree.kv_indices), (tree.full_kv_num_blocks, tree.full_kv_indices)):
        listed = slots < num[:, None]
        rows.append(np.nonzero(listed)[0])
        cols.append(idx[listed].astype(np.int64))
    tree_full = np.concatenate([np.zeros(len(rows[0]), dtype=bool), np.ones(len(rows[1]), dtype=bool)])
    r, c = np.concatenate(rows), np.concatenate(cols)
    big = np.iinfo(np.int64).max // 4
    pos_pad = np.concatenate([pos, np.full(nb * B - n, big)]).reshape(nb, B)  # padding never lowers the least query
    q_min, q_max = pos_pad.min(axis=1), np.where(pos_pad == big, -big, pos_pad).max(axis=1)
    k_min, k_max = q_min, q_max
    keep = q_min[r] - k_max[c] < W
    r, c, tree_full = r[keep], c[keep], tree_full[keep]
    sure = tree_full & (q_max[r] - k_min[c] < W)  # a full tree tile has no padding: every pair is in the window
    full_r, full_c = r[sure], c[sure]
    r, c = r[~sure], c[~sure]
    se_pad = np.concatenate([se, np.zeros(nb * B - n, dtype=np.int64)])  # padded keys are seen by nobody
    pos_flat = pos_pad.reshape(-1)
    ar = np.arange(B)
    counts = np.empty(len(r), dtype=np.int64)
    step = max(1, _WINDOW_STEP_PAIRS // (B * B))
    for a in range(0, len(r), step):
        q = (r[a : a + step, None] * B + ar)[:, :, None]  # [T, B, 1]
        k = (c[a : a + step, None] * B + ar)[:, None, :]  # [T, 1, B]
        seen = (k <= q) & (q < se_pad[k]) & (q < n) & (pos_flat[q] - pos_flat[k] < W)
        counts[a : a + step] = seen.sum(axis=(1, 2))
    full = counts == B * B
    part = (counts > 0) & ~full
    return BlockArrays(
        B, *_layout(r[part], c[part], nb), *_layout(np.concatenate([full_r, r[full]]), np.concatenate([full_c, c[full]]), nb)
    )


def cu_seqlens(parent: Any) -> np.ndarray:
    """flash-attn varlen offsets, int32 [R+1], for a forest with no sharing (each node at most one child, so the
    mask is block-diagonal causal), by the C core (``tp_mask_cu_seqlens``); TreepackError naming ``parent`` when a node
    has a second child (use the block-sparse or slices lowering then)."""
    par = _tree_array("parent", parent)
    out = np.zeros(len(par) + 1, dtype=np.int32)
    roots = ctypes.c_int64(0)
    a = _native.pointer
    _native.check(
        _native.core().tp_mask_cu_seqlens(a(par), len(par), a(out), len(out), ctypes.byref(roots)), "tp_mask_cu_seqlens", "parent"
    )
    seqlens: np.ndarray = out[: roots.value + 1].copy()
    return seqlens


def slices_from_tree(parent: Any, subtree_end: Any) -> np.ndarray:
    """The ``--masks slices`` lowering (MagiAttention ranges), int32 [K, 5], by the C core (``tp_mask_slices``)."""
    par, se = _tree_array("parent", parent), _tree_array("subtree_end", subtree_end)
    if par.shape != se.shape:
        raise _fail("parent", f"parent has {len(par)} elements but subtree_end has {len(se)}")
    lib, a = _native.core(), _native.pointer
    count = ctypes.c_int64(0)
    out = np.zeros((max(1, 2 * len(par)), 5), dtype=np.int32)
    rc = lib.tp_mask_slices(a(par), a(se), len(par), a(out), out.shape[0], ctypes.byref(count))
    if rc == _abi.TP_ERR_CAPACITY:  # the second call has the capacity the first reported
        out = np.zeros((count.value, 5), dtype=np.int32)
        rc = lib.tp_mask_slices(a(par), a(se), len(par), a(out), out.shape[0], ctypes.byref(count))
    _native.check(rc, "tp_mask_slices", "parent")
    slices: np.ndarray = out[: count.value].copy()
    return slices


def magi_ranges(parent: Any, subtree_end: Any) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """MagiAttention's ``q_ranges``, ``k_ranges`` and ``attn_type_map`` (0 full, 1 causal) built from the tree."""
    s = slices_from_tree(parent, subtree_end)
    return s[:, 0:2].tolist(), s[:, 2:4].tolist(), s[:, 4].tolist()


def tree_mask_mod(subtree_end: Any, position_ids: Any = None, window: int | None = None) -> Callable[[Any, Any, Any, Any], Any]:
    """FlexAttention ``mask_mod`` of the tree rule, with a sliding window when ``window`` is given (then
    ``position_ids`` too); both torch int tensors on the attention's device."""

    last = max(int(subtree_end.shape[0]) - 1, 0)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # FlexAttention may evaluate padded positions of the last block (kv_idx >= N): clamp the lookup; such
        # keys fail kv_idx <= q_idx for every real query anyway.
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx.clamp(max=last)])

    if window is None:
        return mask_mod

    def windowed_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        near = position_ids[q_idx.clamp(max=last)] - position_ids[kv_idx.clamp(max=last)] < window
        return mask_mod(b, h, q_idx, kv_idx) & near

    return windowed_mod


def flex_block_mask(mb: MicroBatch, device: str = "cuda") -> Any:
    """A torch ``BlockMask`` (batch 1, broadcast over heads) from the stored block arrays and ``subtree_end``.

    Full blocks skip the mask_mod; partial ones evaluate it. Costs O(nb²) copies, no N² work.
    """
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    arrays = block_arrays(mb)
    n = len(mb.subtree_end)
    subtree_end = torch.as_tensor(np.ascontiguousarray(mb.subtree_end), device=device)

    def t(a: np.ndarray) -> Any:
        return torch.as_tensor(np.ascontiguousarray(a), device=device)[None, None]

    return BlockMask.from_kv_blocks(
        t(arrays.kv_num_blocks),
        t(arrays.kv_indices),
        t(arrays.full_kv_num_blocks),
        t(arrays.full_kv_indices),
        BLOCK_SIZE=arrays.block_size,
        mask_mod=tree_mask_mod(subtree_end),
        seq_lengths=(n, n),
    )


def magi_slices(mb: MicroBatch) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """MagiAttention's ``q_ranges``, ``k_ranges`` and ``attn_type_map`` (0 full, 1 causal) from the stored slices."""
    if "slices" not in mb.extra:
        raise _fail("slices", "no slices in this micro-batch (pack it with --masks slices)")
    s = np.asarray(mb.extra["slices"])
    if s.dtype != np.int32 or s.ndim != 2 or s.shape[1] != 5:
        raise _fail("slices", f"expected int32 [K, 5], got {s.dtype} {list(s.shape)}")
    return s[:, 0:2].tolist(), s[:, 2:4].tolist(), s[:, 4].tolist()
