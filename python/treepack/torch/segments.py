"""The radix segments of a packed forest, and the plans the tree-aware convolution and recurrent layers run on.

A segment is a maximal run of single-child nodes: its nodes are contiguous in DFS order, it starts at a root or at
a child of a branch point and ends at a branch point or a leaf. Node i continues the segment of node i-1 exactly when
``subtree_end[i] == subtree_end[i-1]`` (i-1's only child is i), so the segments come from ``subtree_end`` alone and
the layers, which only see the ``TreeMask``, derive them once per micro-batch (cached on the mask).

    >>> import torch, treepack, treepack.torch as tpt
    >>> mask = tpt.tree_mask(tpt.load_microbatch(treepack.list_microbatches("packed")[0]))   # a chain, two branches
    >>> seg = segments_of(mask)                      # Segments: start, length, parent, depth, offset per segment
    >>> seg.start.tolist(), seg.length.tolist(), seg.parent.tolist(), seg.offset.tolist()
    ([0, 4, 7], [4, 3, 3], [-1, 0, 0], [0, 4, 4])
    >>> plan = run_plan(mask, align=1, device=torch.device("cpu"))   # the recurrence's calls, batched per depth level
    >>> [call.nodes.tolist() for call in plan.calls]                 # the chain, then both branches in one call
    [[[0, 1, 2, 3]], [[4, 5, 6], [7, 8, 9]]]

``run_plan(align=A)`` runs each segment from path position ``A*floor(a/A)`` (a: the segment's first position in its
sequences) to its end (a leaf) or to ``A*floor(b/A)`` (a branch point ending at b), re-running the ancestors' tokens
between the aligned start and a in the segment's own row: every row then starts on the unpacked run's chunk grid
(ART's chunk alignment). ``align=1`` runs each segment exactly once from its parent's final state (no repeated work).

``sub_forest(mask, first)`` is nodes [first, N) of a forest whose nodes [0, first) are a chain (a step plan's cached
prefix, python/treepack/torch/stepplan.py) as a forest of its own: its roots that continue the chain (children of
node first - 1) start from the chain's final state instead of zeros (``Call.hang``). Context parallelism's local
forests (python/treepack/torch/cp_recurrent.py) hang roots the same way from states computed on other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..microbatch import TreepackError


@dataclass(frozen=True)
class Segments:
    """Per segment (DFS order, so a parent segment comes before its children): ``start`` (first node), ``length``,
    ``parent`` (parent segment, -1 at a root), ``depth`` (ancestor segments), ``offset`` (path position of the first
    node: the ancestors' lengths), ``has_children``. Per node: ``pred``, the previous token on its path (the last
    node of the parent segment at a segment start, -1 at a root). All int64 / bool numpy arrays."""

    start: np.ndarray
    length: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    offset: np.ndarray
    has_children: np.ndarray
    pred: np.ndarray

    @property
    def num_levels(self) -> int:
        """The sequential steps of a recurrent layer: the tree's depth in segments."""
        return int(self.depth.max()) + 1 if len(self.depth) else 0


def radix_segments(subtree_end: Any) -> Segments:
    """The segments of the forest given by ``subtree_end`` (a tensor or array, DFS preorder)."""
    se = np.asarray(subtree_end.detach().cpu() if isinstance(subtree_end, torch.Tensor) else subtree_end, dtype=np.int64)
    n = len(se)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return Segments(z, z, z, z, z, z.astype(bool), z)
    start = np.flatnonzero(np.concatenate([[True], se[1:] != se[:-1]]))
    length = np.diff(np.append(start, n))
    S = len(start)
    parent = np.full(S, -1, dtype=np.int64)
    end = se[start]  # one past the segment's subtree
    stack: list[int] = []
    # Few segments per micro-batch (about two per branch point): a plain stack walk.
    for k, s in enumerate(start.tolist()):
        while stack and end[stack[-1]] <= s:
            stack.pop()
        if stack:
            parent[k] = stack[-1]
        stack.append(k)
    depth = np.zeros(S, dtype=np.int64)
    offset = np.zeros(S, dtype=np.int64)
    for k in np.flatnonzero(parent >= 0).tolist():  # parents first (DFS order)
        p = parent[k]
        depth[k] = depth[p] + 1
        offset[k] = offset[p] + length[p]
    pred = np.arange(n, dtype=np.int64) - 1
    pred[start] = np.where(parent >= 0, start[parent] + length[parent] - 1, -1)
    return Segments(start, length, parent, depth, offset, end > start + length, pred)


def _cache(mask: Any) -> dict[Any, Any]:
    cache: dict[Any, Any] | None = getattr(mask, "_cache", None)
    if cache is None or not hasattr(mask, "subtree_end"):
        raise TreepackError(
            "E_ARG", f"expected a TreeMask from treepack.torch.tree_mask(batch), got {type(mask).__name__}", field="attention_mask"
        )
    return cache


def segments_of(mask: Any) -> Segments:
    """The segments of a ``TreeMask``, computed once and cached on it (every layer of a forward shares them)."""
    cache = _cache(mask)
    seg = cache.get("segments")
    if seg is None:
        seg = cache["segments"] = radix_segments(mask.subtree_end)
    return seg


def ancestors(seg: Segments, k: int) -> np.ndarray:
    """[N, k]: column j is pred applied k-1-j times (column k-1 is the node itself), -1 past a root."""
    n = len(seg.pred)
    out = np.empty((n, k), dtype=np.int64)
    cur = np.arange(n, dtype=np.int64)
    for j in range(k - 1, -1, -1):
        out[:, j] = cur
        cur = np.where(cur >= 0, seg.pred[np.maximum(cur, 0)], -1)
    return out


@dataclass(frozen=True)
class ConvFix:
    """The nodes whose kernel-k window in the packed row is not their path's (a segment's first k-1 nodes below a
    branch point, and a root's after other tokens), with their true windows (-1 = zero past the root)."""

    nodes: torch.Tensor  # int64 [F]
    windows: torch.Tensor  # int64 [F, k], oldest first


def conv_fix(mask: Any, k: int, device: torch.device) -> ConvFix:
    """The causal convolution's corrections for kernel size k on ``device`` (cached on the mask)."""
    cache = _cache(mask)
    key = ("conv", k, str(device))
    fix = cache.get(key)
    if fix is None:
        win = ancestors(segments_of(mask), k)
        n = win.shape[0]
        row = np.arange(n, dtype=np.int64)[:, None] - np.arange(k - 1, -1, -1, dtype=np.int64)[None, :]
        row[row < 0] = -1
        nodes = np.flatnonzero((win != row).any(axis=1))
        fix = cache[key] = ConvFix(torch.from_numpy(nodes).to(device), torch.from_numpy(win[nodes]).to(device))
    return fix


@dataclass(frozen=True)
class Call:
    """One batched call of the recurrence: G rows of T tokens, ``nodes`` [G, T] (node ids; ``num_nodes`` stands for a
    zero padding token at a row's end). Row i starts from state ``perm[i]`` of [zeros, then for each (c, rows) in
    ``sources`` the final states of those rows of call c] (``perm`` None: every row starts from zeros), except rows
    ``hang`` (None: none), which continue a chain computed elsewhere (a cached one, ``sub_forest``, or another rank's)
    and start from the given start state ``hang_from`` (index into the start states the caller holds)."""

    nodes: torch.Tensor
    sources: list[tuple[int, torch.Tensor]]
    perm: torch.Tensor | None
    hang: torch.Tensor | None = None
    hang_from: torch.Tensor | None = None


@dataclass(frozen=True)
class RunPlan:
    """The recurrence over the forest as batched calls in depth order (rows of one depth level, grouped by length).
    ``owner`` [N]: where each node's output is, as a flat index into the calls' outputs [G*T] concatenated (one row
    computes it; rows that repeat a token compute the same value)."""

    calls: list[Call]
    owner: torch.Tensor
    num_nodes: int
    rows: int  # how many rows in all (a segment's row, or none when aligned and its run is empty)
    tokens: int  # the rows' tokens without padding (>= N; the repeated tails when aligned)
    padded: int  # with padding
    last: tuple[int, int]  # (call, row) of the row that ends with node N - 1: its final state is the state after it
    seg_rows: np.ndarray  # int64 [S, 2]: (call, row) of each segment's row, (-1, -1) where it has none (aligned)


def run_plan(mask: Any, align: int, device: torch.device) -> RunPlan:
    """The recurrent layers' plan for chunk alignment ``align`` (1: none) on ``device`` (cached on the mask)."""
    if not (isinstance(align, int) and align >= 1):
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {align!r}", field="align")
    cache = _cache(mask)
    key = ("runs", align, str(device))
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = _run_plan(segments_of(mask), align, device, getattr(mask, "hang", None))
    return plan


class SubForest:
    """Nodes [first, N) of the forest ``subtree_end`` (nodes [0, first) a chain: parent p - 1) as a forest of their
    own, for the convolution and recurrence plans (``_cache`` as on a TreeMask). ``hang`` [N - first] int: 0 at the
    local roots whose parent is node first - 1 (they continue the chain from its one state), -1 elsewhere (the forest's
    own roots start from zeros)."""

    def __init__(self, subtree_end: torch.Tensor, first: int):
        se = subtree_end.detach().cpu().numpy().astype(np.int64)
        local = se[first:] - first
        self.subtree_end = torch.from_numpy(local).to(subtree_end.device)
        self._cache: dict[Any, Any] = {}
        seg = segments_of(self)
        roots = seg.start[seg.parent < 0]
        self.hang = np.full(len(local), -1, dtype=np.int64)
        if first:
            hung = roots + first < se[first - 1]  # inside the subtree of the chain's last node
            self.hang[roots[hung]] = 0
            # A root inside the chain's subtree but not its last node's hangs from a chain node above the end.
            above = roots[~hung & (roots + first < se[0])]
            if len(above):
                raise TreepackError(
                    "E_INPUT",
                    f"node {int(above[0]) + first}'s parent is a node of the cached chain [0, {first}) other than its "
                    "last: a recurrent layer's cached state exists only at the end of the chain",
                    field="prefix_tokens",
                )


def sub_forest(mask: Any, first: int) -> SubForest:
    """``SubForest`` of nodes [first, N) of ``mask`` (cached on it)."""
    cache = _cache(mask)
    key = ("sub", first)
    sub = cache.get(key)
    if sub is None:
        sub = cache[key] = SubForest(mask.subtree_end, first)
    return sub


def _groups(ks: np.ndarray, T: np.ndarray) -> list[np.ndarray]:
    """The calls of one depth level: rows by decreasing length, a row joining the current call while the call's
    padded size stays within twice its tokens. Work stays O(tokens); each call is a sequential loop over its longest
    row's chunks, so fewer calls than one per length class (the pure-torch rule's cost on small shapes)."""
    ks = ks[np.argsort(-T[ks], kind="stable")]
    groups, start, total = [], 0, 0
    for i, k in enumerate(ks.tolist()):
        if i > start and (i - start + 1) * T[ks[start]] > 2 * (total + T[k]):
            groups.append(ks[start:i])
            start, total = i, 0
        total += T[k]
    if len(ks):
        groups.append(ks[start:])
    return groups


def _run_plan(seg: Segments, align: int, device: torch.device, hang: np.ndarray | None = None) -> RunPlan:
    n = len(seg.pred)
    a = seg.offset
    b = a + seg.length
    r = a - a % align  # the row's first path position: the chunk boundary at or before the segment's start
    e = np.where(seg.has_children, b - b % align, b)  # a branch point's row stops at its last chunk boundary
    runs = e > r
    S = len(a)
    # A row from r to e: its ancestors' tokens r..a-1 (found by walking pred from the segment's start), then its own.
    tail = (a - r) * runs
    T = e - r
    width = int(tail.max()) if S else 0
    back = np.empty((S, width), dtype=np.int64)  # back[:, j] = pred^(j+1)(start)
    cur = seg.start.copy()
    for j in range(width):
        cur = np.where(cur >= 0, seg.pred[np.maximum(cur, 0)], -1)
        back[:, j] = cur
    # Source state of each segment's row: its parent's row's final state, or (an empty row) the parent's source.
    row_id = np.full(S, -1, dtype=np.int64)
    source = np.zeros(S, dtype=np.int64)
    calls_np: list[tuple[np.ndarray, np.ndarray]] = []
    call_segs: list[np.ndarray] = []
    where: list[tuple[int, int]] = []  # global row -> (call, row in call)
    count = 0
    by_depth = [np.flatnonzero((seg.depth == d) & runs) for d in range(seg.num_levels)]
    for d in range(seg.num_levels):
        for k in np.flatnonzero(seg.depth == d).tolist():
            p = seg.parent[k]
            if p >= 0:
                source[k] = row_id[p] + 1 if runs[p] else source[p]
        ks = by_depth[d]
        if not len(ks):
            continue
        for group in _groups(ks, T):
            width_g = int(T[group].max())
            nodes = np.full((len(group), width_g), n, dtype=np.int64)
            for i, k in enumerate(group.tolist()):
                t = int(tail[k])
                if t:
                    nodes[i, :t] = back[k, :t][::-1]
                own = int(e[k] - a[k])
                nodes[i, t : t + own] = np.arange(seg.start[k], seg.start[k] + own)
                row_id[k] = count
                count += 1
                where.append((len(calls_np), i))
            calls_np.append((nodes, source[group]))
            call_segs.append(group)
    # Owner: among the rows holding a node, the one of the lowest segment (a node's own segment when it runs there).
    flat_nodes = np.concatenate([nodes.ravel() for nodes, _ in calls_np] + [np.zeros(0, dtype=np.int64)])
    flat_seg = np.concatenate([np.repeat(g, c[0].shape[1]) for g, c in zip(call_segs, calls_np)] + [np.zeros(0, dtype=np.int64)])
    pos = np.flatnonzero(flat_nodes < n)
    pos = pos[np.lexsort((flat_seg[pos], flat_nodes[pos]))]  # by node, then segment
    held = flat_nodes[pos]
    first = np.concatenate([[True], held[1:] != held[:-1]])[: len(pos)]
    owner = np.empty(n, dtype=np.int64)
    owner[held[first]] = pos[first]
    if int(first.sum()) != n:
        raise TreepackError("E_INPUT", "the run plan leaves nodes without an output (not a valid forest)", field="subtree_end")
    # Rows of root segments that continue a cached chain (a root's segment always has a row: r = a = 0).
    hangs = np.full(S, -1, dtype=np.int64) if hang is None else np.where(seg.parent < 0, hang[seg.start], -1)
    calls = []
    for (nodes, src), group in zip(calls_np, call_segs):
        hung = np.flatnonzero(hangs[group] >= 0)
        # Each row's start state, gathered per earlier call it comes from (few calls, not one gather per row).
        srcs = [where[j - 1] for j in src.tolist() if j > 0]
        sources, perm, at = [], np.zeros(len(src), dtype=np.int64), 1
        for c in sorted({c for c, _ in srcs}):
            picks = np.flatnonzero([j > 0 and where[j - 1][0] == c for j in src.tolist()])
            sources.append((c, torch.tensor([where[src[i] - 1][1] for i in picks], dtype=torch.int64, device=device)))
            perm[picks] = at + np.arange(len(picks))
            at += len(picks)
        calls.append(
            Call(
                torch.from_numpy(nodes).to(device),
                sources,
                torch.from_numpy(perm).to(device) if sources else None,
                torch.from_numpy(hung).to(device) if len(hung) else None,
                torch.from_numpy(hangs[group][hung]).to(device) if len(hung) else None,
            )
        )
    seg_rows = np.array([where[i] if i >= 0 else (-1, -1) for i in row_id.tolist()], dtype=np.int64).reshape(S, 2)
    last = tuple(seg_rows[S - 1].tolist()) if S else (-1, -1)  # the last segment in DFS order holds node N - 1, a leaf
    return RunPlan(calls, torch.from_numpy(owner).to(device), n, count, len(pos), int(flat_nodes.size), last, seg_rows)
