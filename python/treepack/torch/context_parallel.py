"""Context parallelism for one packed row: its nodes split over a ``torch.distributed`` group, each rank computing
the query rows of a contiguous range of the packed stream (gloo on CPU, NCCL on GPU; docs/guides/context-parallel.md).

    # with torch.distributed as dist and treepack.torch as tpt:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))   # torchrun --nproc-per-node K
    cp = tpt.ContextParallel.of(batch)                # bounds balanced by the tree mask's work, this rank's place
    local = tpt.split_batch(batch, cp)                # this rank's part: an ordinary PackedBatch
    lp = tpt.packed_logprobs(model, local).logprobs   # keys/values exchanged inside every attention layer
    loss, metrics = tpt.packed_loss(lp, local, config)    # global denominators; metrics of the whole row
    loss.backward()
    tpt.reduce_gradients(model, cp)                   # summed over the group: the one-rank gradients

**The split.** ``ContextParallel.bounds`` (K+1 ints) gives rank r the packed positions [bounds[r], bounds[r+1]) of
the row: its query rows, its nodes' final hidden states, and the occurrences that map to them. ``balanced_bounds``
chooses them so that every rank gets about the same work: per row, the keys the tree mask lets it see (its depth
plus one) plus ``token_cost`` for its projections and MLP. A bound may fall inside a radix segment, at a branch
point, anywhere; every rank gets at least one node.

**The local part.** Rows [lo, hi) of a tree see, besides each other, exactly the keys k < lo with subtree_end[k] > lo:
the ancestor chain of node lo (its *context*, A nodes, held by lower ranks). ``split_batch`` returns the forest of
those A context nodes followed by the n local nodes, renumbered (subtree ends cut at hi), whose tree mask restricted
to rows [A, A + n) is the global mask's rows [lo, hi) exactly (windows and sinks included: positions are kept). Its
occurrences are those whose node is local (``seq_positions`` renumbered; every sequence kept, possibly empty, so
per-sequence sums can be all-reduced); ``input_ids``/``position_ids`` and ``routes`` (a MoE row's, replayed by
the routers on the local nodes) cover context and local nodes. The batch's ``context_parallel`` field holds a
``LocalPart``: the split, the context's global node ids, and the exchange routes.

**The forward** (``packed_logprobs`` does it when ``batch.context_parallel`` is set: ``LocalPart.run``). The base
model runs on the local nodes only, with the TreeMask of the local forest whose ``prefix`` attribute is a
``CPForward`` (the hook step plans use, python/treepack/torch/stepplan.py ``_Prefix``): in every attention layer,
``tree_attention`` calls ``prefix.extend(module, q, k, v)``, which fetches the context's keys and values from their
owners (``fetch``: an all-gather forward, its backward an all-reduce that returns every rank's dK/dV to the owner,
so the gradients of shared keys sum), puts them before the local ones, and pads q with A rows that ``attend`` skips
(``prefix.rows`` = A). A sliding-window layer fetches only the context keys its window reaches from some local row
(``LocalPart.window_route``, ``window_context``); the others stay zero rows outside every local row's window. The
final hidden states of the context nodes that are parents of local nodes are fetched the same way, so node p's
logprob (from its parent's row) is computed on p's rank.

**Recurrent layers** (Gated DeltaNet, Mamba2, KDA: every class of ``treepack.torch.LAYERS``) run their tree execution
on the local nodes (python/treepack/torch/cp_recurrent.py): the recurrent layers see ``CPForward`` on the mask and
take the states after their roots' parents, and the convolution inputs of the ancestors their windows read, from
the ranks that computed them (point to point, their gradients returned in backward), reading the whole row's
forest from ``LocalPart.subtree_end``. Each recurrent layer is a pipeline over the ranks (rank r waits for the
states of the lower ranks it hangs from). Token mixers treepack does not run on a tree are refused (``models.check_context_parallel``).

**The loss.** ``packed_loss`` / ``PackedLoss`` on a local part all-reduce (SUM) the per-sequence counts and sums the
aggregation reads (trainable tokens per sequence, hence T and G; GSPO's sequence mean; sequence TIS) and compute
the local occurrences' share of the global loss: the per-rank losses sum to the one-rank loss, and so do their
parameter gradients (``reduce_gradients``: an all-reduce SUM, not DDP's mean). The metrics are the whole row's.
A MoE model's load-balancing loss (``router=``) is added the same way: the experts' counts and its normalisation
all-reduced, each rank's value its share (``treepack.torch.load_balancing_loss``).

Every collective runs under the process group's timeout (``init_process_group(timeout=...)``): a rank that failed or
runs other code makes the others raise TreepackError (E_BACKEND) naming the exchange, never hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..microbatch import TreepackError
from .attention import module_window
from .batch import PackedBatch
from .loss_terms import turn_runs

# What one token's projections and MLP cost, in keys seen (attention (q, k) pairs): the ratio of a dense layer's
# per-token matmuls (~12·D² multiply-adds) to one pair's (~2·D), for a hidden size D of about 1k. Tune per model.
DEFAULT_TOKEN_COST = 6144.0


def _dist() -> Any:
    import torch.distributed as dist

    return dist


@dataclass(frozen=True)
class ContextParallel:
    """One packed row split over a context-parallel group: ``rank`` of ``size`` in ``group`` (None: the default
    group) owns packed positions [bounds[rank], bounds[rank + 1])."""

    group: Any
    rank: int
    size: int
    bounds: tuple[int, ...]

    @property
    def lo(self) -> int:
        """First packed position this rank owns."""
        return self.bounds[self.rank]

    @property
    def hi(self) -> int:
        """One past the last packed position this rank owns."""
        return self.bounds[self.rank + 1]

    @classmethod
    def of(
        cls, batch: PackedBatch, group: Any = None, bounds: Sequence[int] | None = None, token_cost: float = DEFAULT_TOKEN_COST
    ) -> ContextParallel:
        """This process's place in the context-parallel split of ``batch`` over ``group`` (an initialised
        ``torch.distributed`` group; None: the default one): ``bounds`` as given (checked against the group's size),
        or ``balanced_bounds``. No collective runs here; ``split_batch`` checks that every rank holds the same row."""
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise TreepackError("E_ARG", "context parallelism needs torch.distributed initialised (init_process_group)", field="group")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise TreepackError("E_ARG", "this process is not a member of the context-parallel group", field="group")
        n = batch.num_nodes
        b = balanced_bounds(batch.subtree_end, size, token_cost) if bounds is None else _check_bounds(bounds, size, n)
        return cls(group, rank, size, b)


def row_costs(subtree_end: torch.Tensor, token_cost: float = DEFAULT_TOKEN_COST) -> torch.Tensor:
    """float64 [N]: each query row's work, the keys the tree mask lets it see (its depth + 1) plus ``token_cost``.

    >>> row_costs(torch.tensor([5, 5, 4, 4, 5]), token_cost=0).tolist()   # a chain of 2, branches [2, 3] and [4]
    [1.0, 2.0, 3.0, 4.0, 3.0]
    """
    se = subtree_end.detach().to("cpu", torch.int64)
    n = int(se.shape[0])
    # Key k is seen by rows [k, se[k]): +1 at k, -1 at se[k], summed.
    delta = torch.zeros(n + 1, dtype=torch.float64)
    delta.index_add_(0, torch.arange(n), torch.ones(n, dtype=torch.float64))
    delta.index_add_(0, se.clamp(0, n), -torch.ones(n, dtype=torch.float64))
    return torch.cumsum(delta, 0)[:n] + float(token_cost)


def balanced_bounds(subtree_end: torch.Tensor, size: int, token_cost: float = DEFAULT_TOKEN_COST) -> tuple[int, ...]:
    """K + 1 bounds splitting the row into ``size`` contiguous ranges of about equal ``row_costs`` (a row goes to the
    range its cost's midpoint falls in), each of at least one node.

    >>> balanced_bounds(torch.tensor([6] * 6), 2, token_cost=0)   # a chain: rows see 1, ..., 6 keys
    (0, 4, 6)
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {size!r}", field="size")
    n = int(subtree_end.shape[0])
    if n < size:
        raise TreepackError("E_INPUT", f"a row of N = {n} nodes cannot be split over {size} ranks (one node each at least)", field="size")
    cost = row_costs(subtree_end, token_cost)
    cum = torch.cumsum(cost, 0)
    mid = cum - cost / 2
    targets = cum[-1].item() * torch.arange(1, size, dtype=torch.float64) / size
    cuts = torch.searchsorted(mid, targets).tolist()
    bounds = [0]
    for r, c in enumerate(cuts, start=1):
        bounds.append(min(max(int(c), bounds[-1] + 1), n - (size - r)))
    return tuple(bounds + [n])


def _check_bounds(bounds: Sequence[int], size: int, n: int) -> tuple[int, ...]:
    b = tuple(int(x) for x in bounds)
    if len(b) != size + 1:
        raise TreepackError(
            "E_ARG",
            f"bounds split the row over {len(b) - 1} ranks but the context-parallel group has {size}: every rank of the group "
            "must own a part (K + 1 bounds for K ranks)",
            field="bounds",
        )
    if b[0] != 0 or b[-1] != n or any(y <= x for x, y in zip(b, b[1:])):
        raise TreepackError("E_ARG", f"bounds {list(b)} must rise strictly from 0 to N = {n} (every rank owns a node)", field="bounds")
    return b


def _collective(cp: ContextParallel, what: str, run: Callable[[], Any]) -> None:
    """Runs one collective; a failure (the group's timeout, a peer gone) becomes a TreepackError naming it."""
    try:
        run()
    except RuntimeError as e:  # gloo and NCCL raise DistBackendError (a RuntimeError) on timeouts and lost peers
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TreepackError(
            "E_BACKEND",
            f"context-parallel rank {cp.rank} of {cp.size}: {what} failed ({first[:300]}); another rank of the group failed, "
            "left, or runs a different row or model (the wait is bounded by init_process_group's timeout)",
            field="context_parallel",
        ) from None


@dataclass(frozen=True, eq=False)
class Route:
    """Rows each rank fetches from the others: this rank sends its local rows ``send`` (to whoever needs them), every
    rank sends ``width`` rows (padded), and this rank's fetched row i is slot ``slot[i]`` of rank ``owner[i]``."""

    send: torch.Tensor  # int64 [s]: local indices of the rows this rank sends
    width: int  # the most rows any rank sends
    owner: torch.Tensor  # int64 [F]
    slot: torch.Tensor  # int64 [F]


def route_rows(needs: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int, device: torch.device) -> Route:
    """The ``Route`` of every rank's needed rows, each given as (owner rank, row on the owner) [F_r] each: what each
    rank sends, and where this rank's fetched rows are among them."""
    sends = [torch.unique(torch.cat([slot[owner == s] for owner, slot in needs])) for s in range(len(needs))]
    owner, slot = needs[rank]
    at = torch.zeros_like(slot)
    for s in torch.unique(owner).tolist():
        sel = owner == s
        at[sel] = torch.searchsorted(sends[s], slot[sel])
    return Route(sends[rank].to(device), max(int(x.numel()) for x in sends), owner.to(device), at.to(device))


def _route(needs: list[torch.Tensor], bounds: tuple[int, ...], rank: int, device: torch.device) -> Route:
    """The route of ``needs[r]`` (global node ids rank r fetches, ascending; rank r owns [bounds[r], bounds[r+1])); a
    rank may fetch its own rows too, which makes the fetch an all-gather whose backward sums every rank's gradient
    into the owner's)."""
    ends, starts = torch.tensor(bounds[1:]), torch.tensor(bounds[:-1])

    def located(nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.searchsorted(ends, nodes, right=True)
        return owner, nodes - starts[owner]

    return route_rows([located(n) for n in needs], rank, device)


class _Fetch(torch.autograd.Function):
    """x [n, ...] (this rank's rows) → [F, ...] (the rows the route fetches); backward returns each fetched row's
    gradient to its owner, summed over the ranks that fetched it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, route: Route, cp: ContextParallel, what: str, stats: dict[str, int]) -> torch.Tensor:
        ctx.route, ctx.cp, ctx.what, ctx.n, ctx.stats = route, cp, what, x.shape[0], stats
        if route.width == 0:
            return x.new_zeros((0,) + tuple(x.shape[1:]))
        buf = x.new_zeros((route.width,) + tuple(x.shape[1:]))
        buf[: route.send.numel()] = x.index_select(0, route.send)
        parts = [torch.empty_like(buf) for _ in range(cp.size)]
        _collective(cp, f"the all-gather of {what}", lambda: _dist().all_gather(parts, buf, group=cp.group))
        stats["sent_bytes"] = stats.get("sent_bytes", 0) + buf.numel() * buf.element_size()
        stats["received_bytes"] = stats.get("received_bytes", 0) + (cp.size - 1) * buf.numel() * buf.element_size()
        return torch.stack(parts)[route.owner, route.slot]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        route, cp = ctx.route, ctx.cp
        gx = g.new_zeros((ctx.n,) + tuple(g.shape[1:]))
        if route.width == 0:
            return gx, None, None, None, None
        buf = g.new_zeros((cp.size, route.width) + tuple(g.shape[1:]))
        buf.index_put_((route.owner, route.slot), g, accumulate=True)
        _collective(cp, f"the all-reduce of the gradients of {ctx.what}", lambda: _dist().all_reduce(buf, group=cp.group))
        ctx.stats["reduced_bytes"] = ctx.stats.get("reduced_bytes", 0) + buf.numel() * buf.element_size()
        gx.index_add_(0, route.send, buf[cp.rank, : route.send.numel()])
        return gx, None, None, None, None


@dataclass(frozen=True, eq=False)
class LocalPart:
    """What a local part (``split_batch``) knows of the split: ``cp``, ``context`` (the global node id of each of its
    first A nodes, the ancestor chain of node ``cp.lo``, ascending), the routes of the context's keys/values (``kv``)
    and of the final hidden states its local nodes' logprobs read (``hidden``: ``hidden_rows`` are their places in
    the context), ``num_nodes`` (the whole row's N); ``stats`` counts the bytes this rank's exchanges moved;
    ``subtree_end`` is the whole row's, from which the recurrent layers derive every rank's state hand-overs, and
    ``position_ids`` the whole row's, from which every rank derives the routes of the sliding-window layers
    (``window_route``); ``turns`` (with turn ids) numbers the row's turns for turn-level aggregation."""

    cp: ContextParallel
    context: torch.Tensor
    num_nodes: int
    kv: Route
    hidden: Route
    hidden_rows: torch.Tensor
    stats: dict[str, int] = field(default_factory=dict, compare=False)
    subtree_end: torch.Tensor | None = field(default=None, compare=False)
    position_ids: torch.Tensor | None = field(default=None, compare=False)
    windows: dict[int, tuple[Route, torch.Tensor]] = field(default_factory=dict, compare=False)
    # turn-level aggregation: each local occurrence's turn and each turn's sequence, numbered over the whole row
    turns: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)

    @property
    def rows(self) -> int:
        """A: the context nodes before the local ones (not computed on this rank)."""
        return int(self.context.shape[0])

    def fetch(self, x: torch.Tensor, route: Route, what: str) -> torch.Tensor:
        """``route``'s rows of the group's ``x`` (this rank's [n, ...]), differentiable: [F, ...]. Every rank of the
        group must call it, in the same order, with the same route's shape."""
        fetched: torch.Tensor = _Fetch.apply(x, route, self.cp, what, self.stats)
        return fetched

    def window_route(self, window: int) -> tuple[Route, torch.Tensor] | None:
        """The route of the context keys a sliding-window layer can see and their places in the context (rows of
        [0, A)), or None (no whole-row positions: the layer fetches the whole context). Every rank derives every
        rank's list from the whole row (``window_context``), once per window."""
        if self.position_ids is None or self.subtree_end is None or self.position_ids.dim() != 1:
            return None
        got = self.windows.get(window)
        if got is None:
            se, pos, b = self.subtree_end.cpu(), self.position_ids.cpu(), self.cp.bounds
            needs = [window_context(se, pos, b[r], b[r + 1], window) for r in range(self.cp.size)]
            dev = self.context.device
            rows = torch.searchsorted(self.context.cpu(), needs[self.cp.rank]).to(dev)
            got = self.windows[window] = (_route(needs, b, self.cp.rank, dev), rows)
        return got

    def run(self, base: torch.nn.Module, batch: PackedBatch, mask: Any, recurrent: Any) -> torch.Tensor:
        """The base model on this rank's local nodes against the context: final hidden states [A + n, D] (the
        context's rows zero except those parents of local nodes, fetched from their owners). ``recurrent``: what runs
        recurrent layers across ranks (python/treepack/torch/cp_recurrent.py, passed in because it imports this
        module); the caller has checked the model (``models.check_context_parallel``)."""
        if getattr(mask, "subtree_end", None) is None:
            raise TreepackError(
                "E_ARG",
                "context parallelism exchanges keys/values inside treepack's attention: load the model with attn_implementation='treepack'",
                field="attn_implementation",
            )
        A = self.rows
        mask.prefix = CPForward(self, recurrent)
        out = base(input_ids=batch.input_ids[None, A:], position_ids=batch.position_ids[None, A:], attention_mask=mask, use_cache=False)
        hidden = out.last_hidden_state[0]
        got = self.fetch(hidden, self.hidden, "the final hidden states")
        context = hidden.new_zeros((A, hidden.shape[1])).index_copy(0, self.hidden_rows, got)
        return torch.cat([context, hidden])

    def all_reduce(self, t: torch.Tensor, what: str, op: str = "sum") -> torch.Tensor:
        """``t`` (no gradient) summed (or ``op`` "min"/"max") over the group, in place."""
        dist = _dist()
        rop = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        _collective(self.cp, f"the all-reduce of {what}", lambda: dist.all_reduce(t, op=rop, group=self.cp.group))
        return t


class CPForward:
    """Set as ``prefix`` on the local part's TreeMask for one forward (the step plans' hook in ``tree_attention``):
    ``rows`` context rows come first and are not computed; ``extend`` puts the context's keys/values, fetched from
    their owners, before this rank's: of a sliding-window layer only the keys some local query's window reaches (the
    others stay zero rows, outside every local query's window). ``keep`` is the step plan's capture hook (nothing to
    keep here)."""

    def __init__(self, part: LocalPart, recurrent: Any) -> None:
        self.part, self.rows, self.recurrent = part, part.rows, recurrent

    def keep(self, key: Any, tensor: torch.Tensor, width: int | None = None) -> None:
        """Nothing is cached across forwards under context parallelism."""

    def extend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        """q, k, v [1, H(kv), n, D] → [1, H(kv), A + n, D]: the context's keys/values before the local ones, q padded
        with A zero rows (``attend`` skips them)."""
        A = self.rows
        layer = getattr(module, "layer_idx", "?")
        window = module_window(module)
        route = None if window is None else self.part.window_route(window)
        if route is None:
            kc, vc = fetch_keys_values(key, value, lambda x: self.part.fetch(x, self.part.kv, f"layer {layer}'s keys/values"))
        else:
            what = f"layer {layer}'s keys/values in its window"
            kc, vc = in_rows(fetch_keys_values(key, value, lambda x: self.part.fetch(x, route[0], what)), route[1], A)
        q = torch.cat([query.new_zeros(query.shape[:2] + (A, query.shape[3])), query], dim=2)
        return q, torch.cat([kc, key], dim=2), torch.cat([vc, value], dim=2)


def fetch_keys_values(
    key: torch.Tensor, value: torch.Tensor, fetch: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values [1, H(kv), n, D] as rows [n, 2·H·D] through ``fetch`` (a route's ``_Fetch``), back as
    the fetched keys and values [1, H(kv), F, D]: one message per layer for both."""
    n = key.shape[2]
    k2, v2 = key[0].transpose(0, 1).reshape(n, -1), value[0].transpose(0, 1).reshape(n, -1)
    got = fetch(torch.cat([k2, v2], dim=1))
    F = got.shape[0]
    kc = got[:, : k2.shape[1]].reshape(F, key.shape[1], key.shape[3]).transpose(0, 1)[None]
    vc = got[:, k2.shape[1] :].reshape(F, value.shape[1], value.shape[3]).transpose(0, 1)[None]
    return kc, vc


def in_rows(kv: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetched keys and values [1, H(kv), F, D] put at ``rows`` of n zero rows (differentiable): the places a window
    layer's fetch leaves out are keys no query it computes can see, so their values never count."""

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(t.shape[:2] + (n, t.shape[3])).index_copy(2, rows, t)

    return put(kv[0]), put(kv[1])


def window_context(se: torch.Tensor, pos: torch.Tensor, lo: int, hi: int, window: int) -> torch.Tensor:
    """The context keys (``_context``: ancestors k < lo of node lo) that rows [lo, hi) see through a sliding
    ``window``: k is an ancestor of the local rows [lo, min(se[k], hi)) (its subtree holds lo), and seen when the least
    position among them is within the window of k's (``position_ids[q] - position_ids[k] < window``).

    >>> se, pos = torch.tensor([6, 6, 6, 4, 6, 6]), torch.tensor([0, 1, 2, 3, 3, 4])   # a chain of 3 branching at 2
    >>> window_context(se, pos, 3, 6, 2).tolist(), window_context(se, pos, 4, 6, 2).tolist()
    ([2], [2])
    """
    k = _context(se, lo)
    if k.numel() == 0:
        return k
    least = torch.cummin(pos[lo:hi], 0).values
    return k[least[se[k].clamp(max=hi) - lo - 1] - pos[k] < window]


def _context(se: torch.Tensor, lo: int) -> torch.Tensor:
    """The ancestor chain of node lo: keys k < lo with subtree_end[k] > lo, ascending."""
    k = torch.arange(lo, device=se.device)
    return k[se[:lo] > lo]


def local_tree(
    parent: torch.Tensor, subtree_end: torch.Tensor, context: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forest of a rank's ``context`` nodes (ascending global ids) then nodes [lo, hi): their global ids, and their
    parents and subtree ends renumbered to it (subtree ends cut at hi)."""
    A = int(context.shape[0])
    nodes = torch.cat([context, torch.arange(lo, hi, device=context.device)])
    g = parent[nodes]
    inside = torch.searchsorted(context, g.clamp(min=0)).clamp(max=max(A - 1, 0))
    return nodes, torch.where(g < 0, g, torch.where(g >= lo, g - lo + A, inside)), A + subtree_end[nodes].clamp(max=hi) - lo


def split_batch(batch: PackedBatch, cp: ContextParallel, check: bool = True) -> PackedBatch:
    """This rank's local part of ``batch`` (module docstring): context then local nodes, local occurrences, and
    ``context_parallel`` set. With ``check`` (one small all-gather), every rank must hold the same row and bounds:
    a TreepackError on every rank names the ranks that differ."""
    if not isinstance(batch, PackedBatch):
        raise TreepackError("E_ARG", f"expected a PackedBatch, got {type(batch).__name__}", field="batch")
    if batch.context_parallel is not None:
        raise TreepackError("E_ARG", "this batch is already a rank's local part", field="batch")
    N = batch.num_nodes
    bounds = _check_bounds(cp.bounds, cp.size, N)
    if check:
        _check_same_row(batch, cp)
    dev = batch.device
    se = batch.subtree_end.to(torch.int64)
    lo, hi = bounds[cp.rank], bounds[cp.rank + 1]
    contexts = [_context(se, bounds[r]).cpu() for r in range(cp.size)]
    context = contexts[cp.rank].to(dev)
    A = int(context.shape[0])
    nodes, parent, subtree_end = local_tree(batch.parent, se, context, lo, hi)
    occ = (batch.seq_positions >= lo) & (batch.seq_positions < hi)
    counts = torch.zeros(batch.num_sequences, dtype=torch.int64, device=dev).index_add_(0, batch.seq_index, occ.to(torch.int64))
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])

    # The parents in the context of each rank's local nodes: the hidden rows it fetches.
    def hidden_need(r: int) -> torch.Tensor:
        p = batch.parent[bounds[r] : bounds[r + 1]].cpu()
        need: torch.Tensor = torch.unique(p[(p >= 0) & (p < bounds[r])])
        return need

    hneeds = [hidden_need(r) for r in range(cp.size)]
    turns = None
    if batch.turn_ids is not None:
        run, run_seq = turn_runs(batch.seq_offsets.long(), batch.seq_index.long(), batch.turn_ids)
        turns = (run[occ], run_seq[: int(run[-1]) + 1 if run.numel() else 0])
    part = LocalPart(
        cp=replace(cp, bounds=bounds),
        context=context,
        num_nodes=N,
        kv=_route(contexts, bounds, cp.rank, dev),
        hidden=_route(hneeds, bounds, cp.rank, dev),
        hidden_rows=torch.searchsorted(contexts[cp.rank], hneeds[cp.rank]).to(dev),
        subtree_end=se,
        position_ids=batch.position_ids,
        turns=turns,
    )
    pad = batch.num_pad_tokens
    meta = dict(batch.meta)
    meta["num_tokens_packed"] = A + hi - lo
    meta["num_pad_tokens"] = max(0, hi - max(lo, N - pad)) if pad else 0

    def opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[occ]

    return PackedBatch(
        input_ids=batch.input_ids[nodes],
        position_ids=batch.position_ids[nodes],
        parent=parent,
        subtree_end=subtree_end,
        seq_offsets=offsets,
        seq_positions=batch.seq_positions[occ] - lo + A,
        loss_mask=batch.loss_mask[occ],
        seq_index=batch.seq_index[occ],
        token_index=batch.token_index[occ],
        meta=meta,
        advantages=opt(batch.advantages),
        old_logprobs=opt(batch.old_logprobs),
        ref_logprobs=opt(batch.ref_logprobs),
        rollout_logprobs=opt(batch.rollout_logprobs),
        turn_ids=opt(batch.turn_ids),
        routes=None if batch.routes is None else batch.routes[:, nodes],
        extra={},
        context_parallel=part,
    )


def _check_same_row(batch: PackedBatch, cp: ContextParallel) -> None:
    """Every rank holds the same row and bounds (a fingerprint all-gathered), else a TreepackError on every rank."""
    se, ids = batch.subtree_end.to("cpu", torch.int64), batch.input_ids.to("cpu", torch.int64)
    w = torch.arange(1, se.shape[0] + 1, dtype=torch.int64)
    mine = torch.tensor(
        [batch.num_nodes, batch.num_occurrences, int((se * w).sum()), int((ids * w).sum()), hash(cp.bounds) & (2**62 - 1)],
        dtype=torch.int64,
    )
    dist = _dist()
    device = batch.device if dist.get_backend(cp.group) == "nccl" else torch.device("cpu")
    parts = [torch.empty_like(mine, device=device) for _ in range(cp.size)]
    _collective(cp, "the check that every rank holds the same row", lambda: dist.all_gather(parts, mine.to(device), group=cp.group))
    differ = [r for r, p in enumerate(parts) if not torch.equal(p.cpu(), parts[0].cpu())]
    if differ:
        raise TreepackError(
            "E_INPUT",
            f"context-parallel rank(s) {differ} hold a different row or bounds than rank 0 (N, M, tree, ids, bounds differ): every rank "
            "of the group must split the same packed row",
            field="context_parallel",
        )


def reduce_gradients(model: torch.nn.Module, cp: ContextParallel) -> None:
    """Sums every parameter's gradient over the context-parallel group (one all-reduce): each rank's gradient is its
    local part's share, and their sum is the one-rank gradient. A parameter without a gradient counts as zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    _collective(cp, "the all-reduce of the parameter gradients", lambda: _dist().all_reduce(flat, group=cp.group))
    for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


__all__ = [
    "CPForward",
    "ContextParallel",
    "DEFAULT_TOKEN_COST",
    "LocalPart",
    "Route",
    "balanced_bounds",
    "fetch_keys_values",
    "in_rows",
    "reduce_gradients",
    "row_costs",
    "split_batch",
    "window_context",
]
