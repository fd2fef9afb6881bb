"""FlexAttention's block lists of the tree rule, built with torch ops on ``subtree_end``'s own device.

Query q sees key k iff ``k <= q < subtree_end[k]`` (and, with a window, ``position_ids[q] - position_ids[k] <
window``). ``block_arrays`` gives, for query rows [q_start, N) in blocks of B and keys [0, N) in blocks of B, the kv
blocks each query block sees in part and in whole: the lists ``tree_mask`` hands to ``BlockMask.from_kv_blocks``.
Everything is tensor work whose shapes depend on N, B and q_start only: no value leaves the device, so building a
mask never waits for the device (a host round trip per forward is what this replaces). For q_start = 0 the result
equals the C core's ``tp_mask_blocks`` (``treepack.flex.block_arrays_from_tree``) and, windowed,
``treepack.flex.block_arrays_windowed`` element for element: ascending indices, 0-padded; a tile is full only when
all B² pairs are visible (padding counts as masked), partial when some are.

    >>> import torch
    >>> subtree_end = torch.tensor([10, 10, 10, 10, 7, 7, 7, 10, 10, 10])   # a chain of 4, branches of 3
    >>> kv_num, kv_idx, full_num, full_idx = block_arrays(subtree_end, 4)    # query blocks [0, 4), [4, 8), [8, 10)
    >>> kv_num.tolist(), kv_idx.tolist()
    ([1, 1, 3], [[0, 0, 0], [1, 0, 0], [0, 1, 2]])
    >>> full_num.tolist(), full_idx.tolist()                                  # rows 4-7 see all of keys 0-3
    ([0, 1, 0], [[0, 0, 0], [0, 0, 0], [0, 0, 0]])
    >>> kv_num, kv_idx, full_num, full_idx = block_arrays(subtree_end, 4, q_start=6)   # rows [6, 10)
    >>> kv_num.tolist(), kv_idx.tolist(), full_num.tolist()
    ([2], [[1, 2, 0]], [1])
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

import torch

from ..errors import TreepackError
from ..flex import check_window

Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_host_tree(se: torch.Tensor) -> None:
    """The C core's tree check (every ``subtree_end[p]`` in (p, N]) of a tree on the host, a TreepackError naming
    ``subtree_end``. ``block_arrays`` checks only trees on the CPU: reading a device's values back would synchronise
    every forward (the loader that put them there checked them)."""
    ar = torch.arange(se.shape[0])
    bad = (se <= ar) | (se > se.shape[0])
    if bool(bad.any()):
        p = int(torch.argmax(bad.to(torch.int8)))
        message = f"not a packed forest: subtree_end[{p}] = {int(se[p])} is outside ({p}, {se.shape[0]}]"
        raise TreepackError("E_INPUT", message, field="subtree_end")


def _layout(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's (counts [nq], indices [nq, nkv]) of a bool [nq, nkv] tile grid: ascending, 0-padded."""
    nq, nkv = sel.shape
    cols = torch.arange(nkv, device=sel.device).expand(nq, nkv)
    # Listed tile t of a row goes to slot t; unlisted tiles to a column of their own past nkv: no two writes collide,
    # so the scatter is deterministic on every device.
    target = torch.where(sel, torch.cumsum(sel, 1) - 1, nkv + cols)
    idx = torch.zeros(nq, 2 * nkv, dtype=torch.int32, device=sel.device).scatter_(1, target, cols.to(torch.int32))
    return sel.sum(1, dtype=torch.int32), idx[:, :nkv]


def _blocked(x: torch.Tensor, rows: int, B: int, fill: Any) -> torch.Tensor:
    """x [M] padded with ``fill`` to [rows, B]."""
    return torch.cat([x, x.new_full((rows * B - x.shape[0],), fill)]).reshape(rows, B)


def _range_min(pos: torch.Tensor, B: int) -> Any:
    """min(pos[a:b]) for 1 <= b - a <= B, by a sparse table (O(N log B) once, O(1) per query)."""
    n = pos.shape[0]
    big = torch.iinfo(torch.int64).max
    levels = [pos]
    while 2 ** len(levels) <= B:
        half = 2 ** (len(levels) - 1)
        prev = levels[-1]
        levels.append(torch.minimum(prev, torch.cat([prev[half:], prev.new_full((min(half, n),), big)])))
    table = torch.stack(levels).reshape(-1)

    def query(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        length = b - a
        lvl = sum((length >= 2**t).to(torch.int64) for t in range(1, len(levels)))
        return torch.minimum(table[lvl * n + a], table[lvl * n + b - (1 << lvl)])

    return query


def block_arrays(
    subtree_end: torch.Tensor,
    block_size: int,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
    q_start: int = 0,
) -> Arrays:
    """(kv_num_blocks [nq], kv_indices [nq, nkv], full_kv_num_blocks [nq], full_kv_indices [nq, nkv]), int32 on
    ``subtree_end``'s device, for query rows [q_start, N) (query block i: rows [q_start + i·B, q_start + (i+1)·B))
    against keys [0, N) (kv block j: keys [j·B, (j+1)·B)); nq = ceil((N - q_start) / B), nkv = ceil(N / B). With
    ``window`` (then ``position_ids`` too), only pairs with ``position_ids[q] - position_ids[k] < window``."""
    if not (isinstance(block_size, Integral) and not isinstance(block_size, bool) and 1 <= block_size < 2**31):
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {block_size!r}", field="block_size")
    n, B, dev = int(subtree_end.shape[0]), int(block_size), subtree_end.device
    if isinstance(q_start, bool) or not isinstance(q_start, Integral) or not 0 <= q_start <= n:
        raise TreepackError("E_ARG", f"expected an integer in [0, N = {n}], got {q_start!r}", field="q_start")
    q_start = int(q_start)
    if window is not None:
        window = check_window(window)
        if position_ids is None or position_ids.shape != subtree_end.shape:
            raise TreepackError("E_ARG", f"a windowed mask needs position_ids of N = {n} elements", field="position_ids")
    if dev.type == "cpu":
        check_host_tree(subtree_end)
    nkv, nq = -(-n // B), -(-(n - q_start) // B)
    if nq == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        return empty, empty.new_zeros(0, nkv), empty, empty.new_zeros(0, nkv)
    k = torch.arange(n, device=dev)
    # Clamped into (k, N]: a device tree nobody checked cannot send an index out of bounds (the CPU one was checked).
    se = torch.maximum(subtree_end.to(torch.int64), k + 1).clamp(max=n)
    qs = q_start + B * torch.arange(nq, device=dev)  # first row of each query block
    i, j = torch.arange(nq, device=dev)[:, None], torch.arange(nkv, device=dev)[None, :]

    # Key k sees rows [k, se[k]): the query blocks f[k] (its first row at or past q_start) through e[k] (its last row),
    # when it sees any row past q_start at all.
    sees = se > q_start
    f = (torch.clamp(k, min=q_start) - q_start) // B
    e = (se - 1 - q_start).div(B, rounding_mode="floor")

    # Full: every key of block j precedes or is the first row, and every key's subtree reaches the block's last row
    # (which needs a whole query block and a whole kv block).
    lo = _blocked(se, nkv, B, n).amin(1)
    full = ((j + 1) * B <= qs[:, None] + 1) & (qs[:, None] + B <= lo[None, :])

    if window is None:
        # The blocks a key sees form the interval [f, e]; within a kv block f takes two adjacent values at most and
        # e >= f, so the keys' intervals overlap and their union is [least f, greatest e].
        f_lo = _blocked(torch.where(sees, f, nq), nkv, B, nq).amin(1)
        e_hi = _blocked(torch.where(sees, e, -1), nkv, B, -1).amax(1)
        any_seen = (f_lo[None, :] <= i) & (i <= e_hi[None, :])
        return (*_layout(any_seen & ~full), *_layout(full))

    # Positions relative to the least: differences are unchanged and -1 is below every one.
    pos = position_ids.to(device=dev, dtype=torch.int64)
    pos = pos - pos.amin()
    rows = _blocked(pos[q_start:], nq, B, -1)
    q_max = rows.amax(1)
    q_min = torch.where(rows < 0, torch.iinfo(torch.int64).max, rows).amin(1)  # every query block has a real row
    k_min = _blocked(pos, nkv, B, 0).amin(1)  # read for whole kv blocks only (full tiles)
    full &= q_max[:, None] - k_min[None, :] < window

    # Some pair seen: key k sees in block i the rows [max(k, first row), min(se[k], end of block)) of position at
    # least their range minimum. The blocks strictly between f[k] and e[k] it sees whole (their least position);
    # in f[k] and e[k] only part (a range minimum each).
    rmin = _range_min(pos, B)
    first_end = torch.minimum(se, q_start + (f + 1) * B)
    a = torch.clamp(k, min=q_start)
    hit_first = sees & (rmin(torch.where(sees, a, 0), torch.where(sees, first_end, 1)) - pos < window)
    last_start = q_start + e * B
    has_last = sees & (e > f)
    hit_last = has_last & (rmin(torch.where(has_last, last_start, 0), torch.where(has_last, se, 1)) - pos < window)
    cells = nq * nkv
    kb = k // B
    hits = torch.cat([torch.where(hit_first, f * nkv + kb, cells), torch.where(hit_last, e * nkv + kb, cells)])
    seen = torch.zeros(cells + 1, dtype=torch.bool, device=dev).index_fill_(0, hits, True)[:cells].reshape(nq, nkv)

    # The whole blocks: per kv block j, the greatest position of a key with e[k] > i (a suffix maximum over e)
    # decides every block i after f0[j], the first query block of j's keys (a first block, decided exactly above).
    # f[k] is f0[j] or the next, so that is loose only for a key whose first block is i: a tile where it sees itself.
    f0 = (torch.clamp(torch.arange(nkv, device=dev) * B, min=q_start) - q_start) // B
    slot = torch.where(sees, kb * (nq + 1) + e, nkv * (nq + 1))
    best = torch.full((nkv * (nq + 1) + 1,), -1, dtype=torch.int64, device=dev)
    best = best.scatter_reduce_(0, slot, pos, "amax")[:-1].reshape(nkv, nq + 1)
    best = best.flip(1).cummax(1).values.flip(1)[:, 1:].T  # [nq, nkv]: over the keys with e[k] > i
    seen |= (i > f0[None, :]) & (best >= 0) & (q_min[:, None] - best < window)
    return (*_layout(seen & ~full), *_layout(full))
