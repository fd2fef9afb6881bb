"""Recurrent layers (Gated DeltaNet, KDA, Mamba2) on a rank's local part of a row split by context parallelism
(python/treepack/torch/context_parallel.py: rank r owns nodes [bounds[r], bounds[r + 1]) of the packed stream).

The single-rank tree execution (python/treepack/torch/recurrent.py) runs every radix segment from its parent's final
state and reads each token's convolution window through the parent chain. When a prepared layer sees the forward's
``CPForward`` on its mask, it runs the same on the rank's own nodes as a local forest: the row's nodes [lo, hi) with
their segments as in the whole row (a branch point whose other children lie on later ranks still ends its segment
here). Its roots are the row's roots in the range (zero start state) and the nodes whose parent lies on an earlier
rank (DFS order puts every ancestor before its descendants): a segment cut by a rank boundary (possibly spanning
three ranks) or a branch hanging from a branch point computed elsewhere. Such a root starts from the state after its
parent, which the parent's rank computed as the final state of its local segment ending there. A token's window may
likewise reach up to K-1 ancestors on earlier ranks. What moves, point to point, per layer call:

- forward: each rank receives the convolution inputs of the remote ancestors its windows read (at most K-1 per
  hanging root, fewer where roots share them) and the states after the remote parents of its roots, and sends the
  same to later ranks; nothing else (no hidden states, no keys);
- backward: the gradients of exactly these, back to the ranks that produced them, where autograd adds them to the
  local gradients (a state read by several ranks' branches gets the sum, as between segments on one rank).

All ranks derive the same exchange lists from the whole row's ``subtree_end`` (``LocalPart.subtree_end``) and the
bounds, so no lists are exchanged. The states travel through autograd functions (``_Recv`` before the recurrence,
``_Send`` after it, tied to the layer's output so its backward runs whenever the output gets a gradient), the
convolution inputs through one (``_Windows``) that returns the rank's inputs extended by the imported columns.

Cost: the work per rank is its own tokens' (O(local tokens), plus at most K-1 columns and one state per hanging
root); the state hand-over makes each recurrent layer a pipeline over the ranks: rank r's recurrence waits for the
states of the earlier ranks it hangs from, so a layer's forward takes up to K sequential steps of one rank's
recurrence (its backward the same in reverse order), like ART's GDN chain over ranks without the state-summary scan.
The attention layers of a hybrid model run in parallel between them.

Chunk alignment (``prepare(model, chunk_align=True)``) is refused: a segment cut by a rank boundary restarts off the
chunk grid. So is a second run of a layer in one forward (gradient checkpointing's recompute), whose messages the
other ranks would not send again. Messages are point to point (``isend`` / ``irecv``) with tags naming the layer call, tested on gloo; a
wait that fails (a peer gone, the group's timeout) is the TreepackError (E_BACKEND) of every context-parallel
exchange, naming the layer and the peer.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..microbatch import TreepackError
from .context_parallel import LocalPart, _collective
from .recurrent import Tree, run_rows, windows_conv
from .segments import ancestors, radix_segments, segments_of

# Tag offsets of one layer call's messages.
_CONV, _CONV_GRAD, _HEADER, _STATE, _STATE_GRAD = range(5)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HEADER_LEN = 8  # dtype, ndim, up to 6 dims of one state


class LocalForest:
    """Nodes [lo, hi) of the global forest as a forest of their own, for the segments' run plans (``_cache`` as on a
    TreeMask). ``subtree_end`` is shifted, not clipped to the range: a node with children on later ranks ends its
    segment, whose final state they start from. ``hang`` [hi - lo]: the index of a root's start state among the states
    the rank receives, -1 at a global root and at non-roots."""

    def __init__(self, subtree_end: np.ndarray, lo: int, hi: int, hang: np.ndarray, device: torch.device):
        self.subtree_end = torch.from_numpy(subtree_end[lo:hi] - lo).to(device)
        self.hang = hang
        self._cache: dict[str, Any] = {}


@dataclass(frozen=True)
class StatePlan:
    """One rank's recurrence under context parallelism: its ``forest``; the states it receives, in order, as
    (source rank, count); the states it sends as (destination rank, local segment ids whose final states go)."""

    forest: LocalForest
    recv: list[tuple[int, int]]
    send: list[tuple[int, np.ndarray]]


@dataclass(frozen=True)
class ConvPlan:
    """One rank's convolution (kernel k): the imported columns as (source rank, count) in order, the exported ones as
    (destination rank, local node indices); ``nodes`` whose window differs from the local row's, with their windows
    as columns of [imports, local nodes] (-1: zero past a root)."""

    recv: list[tuple[int, int]]
    send: list[tuple[int, torch.Tensor]]
    imports: int
    nodes: torch.Tensor
    windows: torch.Tensor


class _Global:
    """The whole row's arrays every plan reads: ``subtree_end``, ``parent``, the owner rank of each node."""

    def __init__(self, part: LocalPart):
        if part.subtree_end is None:
            raise TreepackError(
                "E_ARG", "this local part does not carry the whole row's subtree_end (treepack.torch.split_batch sets it)", field="batch"
            )
        self.subtree_end = part.subtree_end.detach().cpu().numpy().astype(np.int64)
        self.seg = radix_segments(self.subtree_end)
        self.parent = self.seg.pred  # the previous token on a node's path is its parent
        self.bounds = np.asarray(part.cp.bounds, dtype=np.int64)
        self.owner = self.rank_of(np.arange(len(self.subtree_end)))

    def rank_of(self, nodes: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, nodes, side="right") - 1


def _global(mask: Any, part: LocalPart) -> _Global:
    """``_Global`` of the local part's row, cached on the forward's mask (every layer shares it)."""
    g: _Global | None = mask._cache.get("cp-global")
    if g is None:
        g = mask._cache["cp-global"] = _Global(part)
    return g


def _hangs(g: _Global) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (parent on one rank, child on a later rank) edge: (parent, child's rank), sorted by (child's rank,
    parent) and unique, and each node's index among its rank's received states (-1: none)."""
    q = np.flatnonzero(g.parent >= 0)
    p = g.parent[q]
    cross = g.owner[q] != g.owner[p]
    q, p = q[cross], p[cross]
    pairs = np.unique(np.stack([g.owner[q], p], 1), axis=0).reshape(-1, 2)  # (child's rank, parent)
    index = np.full(len(g.parent), -1, dtype=np.int64)
    for r in np.unique(pairs[:, 0]).tolist():
        ps = pairs[pairs[:, 0] == r, 1]
        mine = q[g.owner[q] == r]
        index[mine] = np.searchsorted(ps, g.parent[mine])
    return pairs[:, 1], pairs[:, 0], index


def _cached(mask: Any, part: LocalPart, key: tuple[Any, ...], build: Callable[[_Global, int, int, int], Any]) -> Any:
    """``build(row, rank, lo, hi)`` for this rank of ``part``, cached on the forward's mask under ``key``."""
    plan = mask._cache.get(key)
    if plan is None:
        g = _global(mask, part)
        r = int(part.cp.rank)
        plan = mask._cache[key] = build(g, r, int(g.bounds[r]), int(g.bounds[r + 1]))
    return plan


def state_plan(mask: Any, part: LocalPart, device: torch.device) -> StatePlan:
    """``StatePlan`` of this rank of the local part ``part`` (cached on the forward's mask)."""
    plan: StatePlan = _cached(mask, part, ("cp-state", str(device)), lambda g, r, lo, hi: _state_plan(g, r, lo, hi, device))
    return plan


def _state_plan(g: _Global, r: int, lo: int, hi: int, device: torch.device) -> StatePlan:
    parents, dest, index = _hangs(g)
    forest = LocalForest(g.subtree_end, lo, hi, index[lo:hi], device)
    seg = segments_of(forest)
    mine = dest == r
    recv = [(int(s), int(c)) for s, c in zip(*np.unique(g.owner[parents[mine]], return_counts=True))]
    ends = seg.start + seg.length - 1  # local segments' last nodes, ascending
    send = []
    for d in range(r + 1, len(g.bounds) - 1):
        ps = parents[(dest == d) & (g.owner[parents] == r)] - lo
        if len(ps):
            at = np.searchsorted(ends, ps)
            # A parent of a later rank's node ends a local segment: a branch point, or the rank's last node.
            assert (at < len(ends)).all() and (ends[np.minimum(at, len(ends) - 1)] == ps).all()
            send.append((d, at))
    return StatePlan(forest, recv, send)


def conv_plan(mask: Any, part: LocalPart, k: int, device: torch.device) -> ConvPlan:
    """``ConvPlan`` of this rank of the local part ``part`` for kernel size k (cached on the forward's mask)."""
    plan: ConvPlan = _cached(mask, part, ("cp-conv", k, str(device)), lambda g, r, lo, hi: _conv_plan(g, r, lo, hi, k, device))
    return plan


def _conv_plan(g: _Global, r: int, lo: int, hi: int, k: int, device: torch.device) -> ConvPlan:
    win = ancestors(g.seg, k)  # [N, k], oldest first
    remote = (win >= 0) & (g.rank_of(np.maximum(win, 0)) != g.owner[:, None])
    imports = np.unique(win[lo:hi][remote[lo:hi]])
    recv = [(int(s), int(c)) for s, c in zip(*np.unique(g.rank_of(imports), return_counts=True))]
    send = []
    for d in range(r + 1, len(g.bounds) - 1):
        a, b = int(g.bounds[d]), int(g.bounds[d + 1])
        w = win[a:b][remote[a:b]]
        cols = np.unique(w[g.rank_of(w) == r]) - lo
        if len(cols):
            send.append((d, torch.from_numpy(cols).to(device)))
    m = len(imports)
    local = win[lo:hi]
    cols = np.where(local >= lo, local - lo + m, np.searchsorted(imports, local))
    cols[local < 0] = -1
    row = np.arange(hi - lo, dtype=np.int64)[:, None] - np.arange(k - 1, -1, -1, dtype=np.int64)[None, :]
    row = np.where(row >= 0, row + m, -1)
    nodes = np.flatnonzero((cols != row).any(axis=1))
    return ConvPlan(recv, send, m, torch.from_numpy(nodes).to(device), torch.from_numpy(cols[nodes]).to(device))


class _Comm:
    """Point-to-point messages of one layer call between the ranks of the local part's group, tagged by the call's
    key; their bytes are counted in ``part.stats`` beside the attention exchanges'."""

    def __init__(self, part: LocalPart, key: tuple[Any, ...], layer: str):
        self.cp, self.stats, self.layer = part.cp, part.stats, layer
        self.base = (zlib.crc32(repr(key).encode()) % (1 << 24)) * 8

    def _peer(self, r: int) -> int:
        group = self.cp.group
        return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)

    # Each message is (peer, work, tensor): the tensor stays referenced until the work is waited on.
    def send(self, t: torch.Tensor, r: int, part: int) -> tuple[int, Any, torch.Tensor]:
        t = t.contiguous()
        self.stats["sent_bytes"] = self.stats.get("sent_bytes", 0) + t.numel() * t.element_size()
        return r, dist.isend(t, self._peer(r), group=self.cp.group, tag=self.base + part), t

    def recv(self, t: torch.Tensor, r: int, part: int) -> tuple[int, Any, torch.Tensor]:
        self.stats["received_bytes"] = self.stats.get("received_bytes", 0) + t.numel() * t.element_size()
        return r, dist.irecv(t, self._peer(r), group=self.cp.group, tag=self.base + part), t

    def wait(self, works: list[tuple[int, Any, torch.Tensor]], what: str) -> None:
        for r, w, _ in works:
            _collective(self.cp, f"{self.layer}: {what} with rank {r}", w.wait)


class _Windows(torch.autograd.Function):
    """x [1, C, n] -> [1, C, m + n]: the imported columns (ancestors on earlier ranks), then x; sends the columns
    later ranks read. Backward returns the imported columns' gradients to their ranks and adds the exported ones'."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: ConvPlan, comm: _Comm) -> torch.Tensor:
        ctx.plan, ctx.comm = plan, comm
        bufs = [x.new_empty((x.shape[1], c)) for _, c in plan.recv]
        works = [comm.recv(b, s, _CONV) for b, (s, _) in zip(bufs, plan.recv)]
        works += [comm.send(x[0].index_select(1, cols), d, _CONV) for d, cols in plan.send]
        comm.wait(works, "the convolution inputs' exchange")
        return torch.cat(bufs + [x[0]], 1)[None]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan, comm = ctx.plan, ctx.comm
        g = grad[0]
        works, at = [], 0
        for s, c in plan.recv:
            works.append(comm.send(g[:, at : at + c], s, _CONV_GRAD))
            at += c
        bufs = [g.new_empty((g.shape[0], int(cols.shape[0]))) for _, cols in plan.send]
        works += [comm.recv(b, d, _CONV_GRAD) for b, (d, _) in zip(bufs, plan.send)]
        comm.wait(works, "the convolution inputs' gradient exchange")
        gx = g[:, plan.imports :].clone()
        for b, (_, cols) in zip(bufs, plan.send):
            gx.index_add_(1, cols, b)
        return gx[None], None, None


class _Recv(torch.autograd.Function):
    """-> the start states [H, ...] this rank's hanging roots read, from the ranks that computed them; backward
    returns their gradients there. ``anchor``, a recurrence input (given no gradient), puts it in the graph on the
    way to the parameters, so ``torch.autograd.grad`` over them runs it too."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, plan: StatePlan, comm: _Comm) -> torch.Tensor:
        heads = [torch.zeros(_HEADER_LEN, dtype=torch.int64) for _ in plan.recv]
        comm.wait([comm.recv(h, s, _HEADER) for h, (s, _) in zip(heads, plan.recv)], "the recurrent states' exchange")
        shapes = {(int(h[0]), tuple(h[2 : 2 + int(h[1])].tolist())) for h in heads}
        if len(shapes) != 1:
            raise TreepackError("E_ARG", f"{comm.layer}: the ranks sent states of different shapes {sorted(shapes)}", field="bounds")
        ((dtype, shape),) = shapes
        bufs = [torch.empty((c,) + shape, dtype=_DTYPES[dtype], device=anchor.device) for _, c in plan.recv]
        comm.wait([comm.recv(b, s, _STATE) for b, (s, _) in zip(bufs, plan.recv)], "the recurrent states' exchange")
        ctx.plan, ctx.comm = plan, comm
        return torch.cat(bufs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        works, at = [], 0
        for s, c in ctx.plan.recv:
            works.append(ctx.comm.send(grad[at : at + c], s, _STATE_GRAD))
            at += c
        ctx.comm.wait(works, "the recurrent states' gradient exchange")
        return None, None, None


class _Send(torch.autograd.Function):
    """out -> out, sending ``states`` (one [c, ...] tensor per destination of ``plan.send``) to the later ranks whose
    roots start from them; backward (run when the layer's output gets its gradient) receives their gradients."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, plan: StatePlan, comm: _Comm, *states: torch.Tensor) -> torch.Tensor:
        works = []
        for st, (d, _) in zip(states, plan.send):
            if st.dtype not in _DTYPES or st.dim() - 1 > _HEADER_LEN - 2:
                raise TreepackError("E_ARG", f"{comm.layer}: cannot send a {st.dtype} state of shape {list(st.shape)}", field="model")
            head = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            head[0], head[1] = _DTYPES.index(st.dtype), st.dim() - 1
            head[2 : 1 + st.dim()] = torch.tensor(st.shape[1:])
            works += [comm.send(head, d, _HEADER), comm.send(st.detach(), d, _STATE)]
        comm.wait(works, "the recurrent states' exchange")
        ctx.plan, ctx.comm = plan, comm
        ctx.meta = [(st.shape, st.dtype, st.device) for st in states]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.meta]
        works = [ctx.comm.recv(b, d, _STATE_GRAD) for b, (d, _) in zip(bufs, ctx.plan.send)]
        ctx.comm.wait(works, "the recurrent states' gradient exchange")
        return (grad, None, None, *bufs)


def _local(tree: Tree, what: str, t: torch.Tensor, dim: int) -> LocalPart:
    """The tree's LocalPart, after checking the layer's setting and the input's length (before any message)."""
    # recurrent.py calls here only under context parallelism; a step plan's pass gives the LocalPart fields read here
    # (cp, subtree_end, stats: python/treepack/torch/cp_plan.py's _Row)
    part: LocalPart = tree.cp
    assert part is not None
    if tree.chunk_align:
        raise TreepackError(
            "E_ARG",
            f"{tree.layer} was prepared with chunk_align=True: under context parallelism a segment cut by a rank boundary restarts "
            "off the chunk grid (prepare(model, chunk_align=False))",
            field="chunk_align",
        )
    cp = part.cp
    lo, hi = cp.bounds[cp.rank], cp.bounds[cp.rank + 1]
    if t.shape[0] != 1 or t.shape[dim] != hi - lo:
        raise TreepackError(
            "E_ARG",
            f"{tree.layer}: context-parallel rank {cp.rank} runs nodes [{lo}, {hi}) of the packed row; {what} has shape {list(t.shape)}",
            field="attention_mask",
        )
    return part


def _once(tree: Tree, key: tuple[Any, ...]) -> None:
    """Refuses a layer call run twice in one forward (gradient checkpointing re-runs it in the backward), before any
    message: the other ranks would not send its messages again."""
    seen = tree.mask._cache.setdefault("cp-calls", set())
    if key in seen:
        raise TreepackError(
            "E_ARG",
            f"{tree.layer} ran again in the same forward (gradient checkpointing?): under context parallelism a recurrent layer's "
            "exchanges run once per forward; turn gradient checkpointing off for a context-parallel row",
            field="gradient_checkpointing",
        )
    seen.add(key)


def conv(
    orig: Callable[..., Any], tree: Tree, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """``causal_conv1d_fn`` on this rank's nodes: x [1, C, n] -> [1, C, n], windows reaching earlier ranks."""
    part = _local(tree, "the convolution input", x, 2)
    key = tree.key("conv")
    _once(tree, key)
    k = int(weight.shape[-1])
    plan = conv_plan(tree.mask, part, k, x.device)
    tree.cp_prefix.keep(key, x[:, :, max(0, x.shape[2] - (k - 1)) :], k - 1)
    chain = plan.recv[0][1] if plan.recv and plan.recv[0][0] < 0 else 0
    if chain:  # the cached chain's last inputs (source -1: nodes before the row, python/treepack/torch/cp_plan.py)
        plan = replace(plan, recv=plan.recv[1:], imports=plan.imports - chain)
    if plan.recv or plan.send:
        # The local row is read through the extended tensor too, so its backward (which receives the exported
        # columns' gradients) runs whenever the output gets a gradient.
        x = _Windows.apply(x, plan, _Comm(part, key, tree.layer))
    if chain:
        x = torch.cat([tree.cp_prefix.tail(key, chain).to(x.dtype), x], 2)
        plan = replace(plan, imports=plan.imports + chain)
    return windows_conv(orig, x[:, :, plan.imports :], x, plan.nodes, plan.windows, weight, bias, activation)


def run(tree: Tree, chunk: int, inputs: tuple[torch.Tensor | None, ...], call: Callable[..., Any]) -> torch.Tensor:
    """recurrent._run on this rank's nodes: roots hanging from earlier ranks start from the states received from
    them; the final states later ranks hang from are sent to them."""
    first = inputs[0]
    assert first is not None
    part = _local(tree, "a recurrence input", first, 1)
    key = tree.key("state")
    _once(tree, key)
    plan = state_plan(tree.mask, part, first.device)
    comm = _Comm(part, key, tree.layer)
    starts, chain = None, None
    if plan.recv and plan.recv[0][0] < 0:  # roots continuing a cached chain (source -1) start from its final state
        chain = tree.cp_prefix.state(key)
        plan = replace(plan, recv=plan.recv[1:])
    if plan.recv:
        starts = _Recv.apply(first, plan, comm)
    if chain is not None:
        starts = chain if starts is None else torch.cat([chain.to(starts.dtype), starts])
    out, finals, rplan = run_rows(plan.forest, 1, inputs, call, None if starts is None else lambda: starts)
    if finals:
        last, i = rplan.last
        tree.cp_prefix.keep(key, finals[last][i : i + 1], None)  # the state after the rank's last node
    if plan.send:
        states = []
        for _, segs in plan.send:
            rows = rplan.seg_rows[segs]
            states.append(torch.stack([finals[c][i] for c, i in rows.tolist()]))
        out = _Send.apply(out, plan, comm, *states)
    return out
