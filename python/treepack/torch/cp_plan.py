"""Step plans over context-parallel groups (docs/design.md §11): the micro-batches the planner gives a group of G ranks
(header ``cp_ranks``), run by those ranks together, each computing 1/G of every pass and holding 1/G of the cache.

The planner's ``cp`` windows size a group's micro-batch at up to G·T computed tokens hanging from a cached chain of up
to G·C; the manifest lists it once, under the group's first rank (``treepack.list_microbatches(dir, rank=r)`` gives a
rank its micro-batches, those of its groups included), and every rank of ``cp_ranks`` runs it, in the same order.
``run_step_plan`` creates the groups' process groups first (``make_groups``: for each group size, every group of
that size, on every rank in the same order, as ``dist.new_group`` requires) and hands such micro-batches to ``CPPlan``:

- **a push** of chain depths [s, e) is split over the group at balanced bounds (``context_parallel.balanced_bounds``):
  rank i runs its range without grad against the keys/values of every depth below it, held by the stack parts of any
  rank or computed in this pass by lower ranks, fetched from their owners in every attention layer
  (``context_parallel._Fetch``; a sliding-window layer fetches only those its range sees, ``window_context``); it
  keeps only its range (``_Part``: per layer keys/values, final hidden states, node logprobs, as leaves that gather
  gradients), so a rank holds 1/G of the cached chain;
- **the micro-batch's nodes** [prefix_tokens, N) are split the same way; a rank's context (the ancestors of its
  first node, ``split_batch``'s rule) comes from the parts holding them or from lower ranks, and the final hidden
  states of the parents its nodes are scored from likewise; the per-node logprobs are then all-gathered, so every
  rank holds the micro-batch's whole [N] and calls ``loss_fn`` on the whole micro-batch (its global denominators
  unchanged); the gather's backward keeps each rank's own rows of that (identical) gradient, so each rank
  back-propagates its share;
- **a pop** recomputes each rank's range with grad against the parts below and back-propagates its leaves'
  gradients, complete by then: every fetch's backward sums the gradients of the rows it fetched into their owners.

A rank whose range of a pass is empty (a pass of fewer than G nodes) still takes part in every exchange: it runs one
throw-away root node, whose results nobody reads (their gradients are zeros). Each rank's parameter gradients are
its share: the group's sum is the micro-batch's gradient, and the data-parallel all-reduce of ``sync_gradients``
(a sum divided by the world size) gives the same result whether the planner chose ``dp``, ``shared`` or ``cp``: a
``cp`` micro-batch's gradient arrives as G shares where a ``dp`` one arrives whole, and both sum the same way. Each
member returns the micro-batch's whole loss: count it once per group (e.g. on ``cp_ranks[0]``).

A MoE model replays the routes (``batch.routes``) of the rows each rank computes; with ``router=True`` a part also
keeps its rows' router logits (leaves) and experts, and the micro-batch's router outputs (every node's: the parts',
then the computed nodes') are all-gathered with the logprobs, so ``loss_fn`` gets the whole micro-batch's
``RouterOutputs``. Recurrent layers run each pass as a row split over the group (python/treepack/torch/cp_recurrent.py,
states and convolution inputs handed from rank to rank), the row's first nodes continuing the cached chain: a part
also keeps, on every rank, per recurrent layer call its segment's final state (the last rank's) and last K-1
convolution inputs (each rank's own columns, a shorter segment's read after the parts' below), through a sum over
the group (``CPPlan._ends``) whose gradient, summed likewise, returns at the pop to the ranks that computed them.
Images are refused by name (run the plan packed without ``--cp``). Every exchange runs under the process
group's timeout; a micro-batch's first exchange checks that every rank of ``cp_ranks`` runs the same micro-batch
and names a rank that does not come (TreepackError, E_BACKEND or E_INPUT), never hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable

from ..microbatch import TreepackError
from . import cp_recurrent
from .attention import module_window, tree_mask
from .batch import PackedBatch
from .context_parallel import (
    ContextParallel,
    Route,
    _collective,
    _context,
    _Fetch,
    balanced_bounds,
    fetch_keys_values,
    in_rows,
    local_tree,
    route_rows,
    window_context,
)
from .logprobs import NodeScores, packed_logprobs, scored_nodes
from .moe import RouterOutputs, replay_routes, router_outputs
from .shared_prefix import _GROUPS, captured_layer, group_of, world_timeout


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def make_groups(ops: Iterable[Any]) -> None:
    """Creates the process groups of every ``cp_ranks`` group size the ops name (``StepOp``s, in plan order): for a
    size G, the world's ranks in consecutive groups of G (the planner's groups), each created on every rank in the same
    order (``dist.new_group``'s contract; a group a shared piece already created is reused). Refuses a ``cp_ranks``
    that is not one of them."""
    dist = _dist()
    sizes: list[int] = []
    for op in ops:
        ranks = tuple(op.cp_ranks)
        if not ranks:
            continue
        if not dist.is_available() or not dist.is_initialized():
            raise TreepackError(
                "E_ARG",
                f"micro-batches planned for context-parallel ranks {list(ranks)} need torch.distributed initialised",
                field="cp_ranks",
            )
        world, G = dist.get_world_size(), len(ranks)
        if world % G or ranks[0] % G or ranks != tuple(range(ranks[0], ranks[0] + G)) or ranks[-1] >= world:
            missing = [r for r in ranks if r >= world]
            raise TreepackError(
                "E_INPUT",
                f"cp_ranks {list(ranks)} is not a context-parallel group of this world of {world} ranks"
                + (f": rank(s) {missing} do not exist (launch {ranks[-1] + 1} or more ranks)" if missing else "")
                + " (the planner's groups are consecutive ranks, G of them, G dividing the world size)",
                field="cp_ranks",
            )
        if G not in sizes:
            sizes.append(G)
            if any(tuple(range(g * G, (g + 1) * G)) not in _GROUPS for g in range(world // G)):
                _meet(None, tuple(range(world)), f"creating the process groups of cp_ranks of {G} ranks")
            for g in range(world // G):
                group_of(tuple(range(g * G, (g + 1) * G)))


def _meet(group: Any, ranks: tuple[int, ...], what: str) -> None:
    """A barrier of ``ranks`` that names those that do not come within the process group's timeout (gloo's
    ``monitored_barrier``; other backends have none: nothing to check here, their collectives time out on their own)."""
    dist = _dist()
    if dist.get_backend(group) != "gloo":
        return
    try:
        dist.monitored_barrier(group=group, timeout=world_timeout(), wait_all_ranks=True)
    except RuntimeError as e:
        got = re.search(r"[Rr]anks? ([\d, ]+) failed", str(e))
        me = dist.get_rank()
        # The group's first rank collects the others and names the missing (by their rank in the group); the others
        # wait on the first.
        missing = [ranks[int(x)] for x in got.group(1).replace(",", " ").split()] if got else []
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else (f"rank {ranks[0]}" if me != ranks[0] else "a rank")
        raise TreepackError(
            "E_BACKEND",
            f"rank {me}: {who} of ranks {list(ranks)} did not come to {what} within the process group's timeout: every rank of "
            "cp_ranks runs the group's micro-batches (treepack.list_microbatches(dir, rank=r) lists a rank's, its groups' included)",
            field="cp_ranks",
        ) from None


def split_bounds(subtree_end: torch.Tensor, start: int, size: int) -> tuple[int, ...]:
    """``size`` + 1 bounds splitting nodes [start, N) of a forest (nodes before ``start`` cached) at balanced costs
    (``balanced_bounds`` of the computed nodes' sub-forest); with fewer nodes than ranks, one node per rank and the last
    ranks empty.

    >>> split_bounds(torch.tensor([6] * 6), 2, 2), split_bounds(torch.tensor([3, 3, 3]), 2, 2)
    ((2, 4, 6), (2, 3, 3))
    """
    n = int(subtree_end.shape[0]) - start
    if n >= size:
        return tuple(start + b for b in balanced_bounds(subtree_end[start:] - start, size))
    return tuple(start + min(r, n) for r in range(size + 1))


class _Part:
    """This rank's share of a segment its group pushed: chain depths [start, end) split at ``bounds`` (G + 1 depths),
    this rank holding [bounds[i], bounds[i + 1]) as leaves that gather gradients (per attention layer its keys and
    values [1, H, n, D], final hidden states [n, D], node logprobs and entropies [n]; with ``router=True`` each MoE
    layer's router logits [n, experts] and the experts used [MoE layers, n, k]); ``ids``/``pos``/``routes`` are the
    whole segment's, to recompute it at the pop (``routes`` [MoE layers, L, k] replayed, None without)."""

    def __init__(
        self, start: int, bounds: tuple[int, ...], ids: torch.Tensor, pos: torch.Tensor, routes: torch.Tensor | None, got: Any
    ) -> None:
        self.start, self.end, self.bounds, self.ids, self.pos = start, start + int(ids.shape[0]), bounds, ids, pos

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_()

        cache, hidden, lp, ent, routed = got
        self.cache = {k: leaf(t) for k, t in cache.items()}
        self.hidden, self.lp = leaf(hidden), leaf(lp)
        self.ent = None if ent is None else leaf(ent)
        self.router_logits = None if routed is None else [leaf(t) for t in routed[0]]
        self.experts = None if routed is None else routed[1]
        # StepPlanRunner._check compares the routes with the micro-batch's; a group's segments have no source (images)
        self.routes, self.source = routes, None
        # Per recurrent layer call (every rank's alike, ``CPPlan._ends``): the state after the segment's last node
        # [1, ...] and its last min(K - 1, length) convolution inputs [1, C, t].
        self.states: dict[Any, torch.Tensor] = {}
        self.tails: dict[Any, torch.Tensor] = {}

    def rows(self, r: int) -> int:
        return self.bounds[r + 1] - self.bounds[r]

    def leaves(self) -> list[torch.Tensor]:
        own = list(self.cache.values()) + [self.hidden, self.lp] + ([] if self.ent is None else [self.ent])
        own += list(self.states.values()) + list(self.tails.values())
        return own + ([] if self.router_logits is None else self.router_logits)

    def nbytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.leaves())


class _Slots:
    """Where the rows of one pass live: rank r's rows are its parts' rows (in stack order), then the rows it computes
    in the pass; ``of(nodes)`` maps global node ids (cached depths below ``start``, or computed nodes) to (owner,
    slot)."""

    def __init__(self, parts: Sequence[_Part], start: int, bounds: tuple[int, ...]) -> None:
        self.parts, self.start, self.bounds = parts, start, bounds
        G = len(bounds) - 1
        self.offsets = [[0] * G]  # per part, the slot its rows start at on each rank
        for p in parts:
            self.offsets.append([o + p.rows(r) for r, o in enumerate(self.offsets[-1])])

    def of(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner, slot = torch.zeros_like(nodes), torch.zeros_like(nodes)
        for j, p in enumerate(self.parts):
            sel = (nodes >= p.start) & (nodes < p.end)
            o = torch.searchsorted(torch.tensor(p.bounds[1:]), nodes[sel], right=True)
            owner[sel] = o
            slot[sel] = torch.tensor(self.offsets[j])[o] + nodes[sel] - torch.tensor(p.bounds)[o]
        sel = nodes >= self.start
        o = torch.searchsorted(torch.tensor(self.bounds[1:]), nodes[sel], right=True)
        owner[sel] = o
        slot[sel] = torch.tensor(self.offsets[-1])[o] + nodes[sel] - torch.tensor(self.bounds)[o]
        return owner, slot


def _local_forest(forest: PackedBatch, context: torch.Tensor, lo: int, hi: int) -> PackedBatch:
    """The context nodes then nodes [lo, hi) of ``forest`` (on the host), renumbered (``split_batch``'s node arrays;
    one sequence through them, nothing read but the node arrays)."""
    nodes, parent, subtree_end = local_tree(forest.parent, forest.subtree_end, context, lo, hi)
    n = int(nodes.shape[0])
    ar = torch.arange(n)
    return PackedBatch(
        input_ids=forest.input_ids[nodes],
        position_ids=forest.position_ids[nodes],
        parent=parent,
        subtree_end=subtree_end,
        seq_offsets=torch.tensor([0, n]),
        seq_positions=ar,
        loss_mask=torch.zeros(n, dtype=torch.bool),
        seq_index=torch.zeros(n, dtype=torch.int64),
        token_index=ar,
        meta={"num_tokens_packed": n},
    )


@dataclasses.dataclass(frozen=True)
class _Row:
    """What python/treepack/torch/cp_recurrent.py reads of a pass (a ``LocalPart``'s fields it uses): the pass's split
    ``cp`` (bounds: global node ids, nodes before ``bounds[0]`` the cached chain, source -1 of its plans), the whole
    forest's ``subtree_end`` and the bytes counter ``stats``."""

    cp: ContextParallel
    subtree_end: torch.Tensor
    stats: dict[str, int]


class _Hook:
    """Set as ``prefix`` on the local forest's TreeMask (the step plans' hook in ``tree_attention``): the context's
    keys/values, fetched from the parts and lower ranks holding them, before this rank's (a sliding-window layer's
    only those its queries can see: ``windowed(window)``, their route and rows among the context's); ``captured`` what
    each layer computed. Recurrent layers run across the ranks through python/treepack/torch/cp_recurrent.py
    (``part``, ``recurrent``: None on a rank whose range is empty, whose throw-away root runs alone), the row's first
    nodes continuing the cached chain from its final state and last convolution inputs (``state``, ``tail``: the top
    part's, which every rank holds); ``kept`` what each recurrent layer call computed, (tensor, width)."""

    def __init__(
        self,
        plan: CPPlan,
        parts: Sequence[_Part],
        rows: int,
        route: Route,
        what: str,
        windowed: Callable[[int], tuple[Route, torch.Tensor]] | None = None,
        part: Any = None,
    ) -> None:
        self.plan, self.parts, self.rows, self.route, self.what, self.windowed = plan, parts, rows, route, what, windowed
        self.part, self.recurrent = part, None if part is None else cp_recurrent
        self.captured: dict[Any, torch.Tensor] = {}
        self.kept: dict[Any, tuple[torch.Tensor, int | None]] = {}
        self.closed = False

    def keep(self, key: Any, tensor: torch.Tensor, width: int | None = None) -> None:
        if self.closed:
            return
        if len(key) == 3:  # (layer, "conv" | "state", ordinal): a recurrent layer's
            self.kept[key] = (tensor, width)
        else:
            self.captured[key] = tensor

    def state(self, key: Any) -> torch.Tensor:
        return self.parts[-1].states[key]

    def tail(self, key: Any, t: int) -> torch.Tensor:
        return torch.cat([p.tails[key] for p in self.parts], 2)[:, :, -t:]

    def extend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        layer = captured_layer(self, module, key, value, "context-parallel step plans")
        # Every rank's rows: its parts' keys/values, then those it computes now (_Slots' order).
        held_k = torch.cat([p.cache[("key", layer)] for p in self.parts] + [key], dim=2)
        held_v = torch.cat([p.cache[("value", layer)] for p in self.parts] + [value], dim=2)
        window = None if self.windowed is None else module_window(module)
        if window is None or self.windowed is None:
            what = f"layer {layer}'s keys/values of {self.what}"
            kc, vc = fetch_keys_values(held_k, held_v, lambda x: self.plan.fetch(x, self.route, what))
        else:  # the rows left out are keys no query of this rank sees through the window
            route, rows = self.windowed(window)
            what = f"layer {layer}'s keys/values in its window of {self.what}"
            kc, vc = in_rows(fetch_keys_values(held_k, held_v, lambda x: self.plan.fetch(x, route, what)), rows, self.rows)
        q = torch.cat([query.new_zeros(query.shape[:2] + (self.rows, query.shape[3])), query], dim=2)
        return q, torch.cat([kc, key], dim=2), torch.cat([vc, value], dim=2)


class _Assemble(torch.autograd.Function):
    """Every rank's rows x [n_r, C] → the whole [N, C] on every rank (row k: slot ``slot[k]`` of rank ``owner[k]``);
    backward keeps this rank's own rows of the gradient, which every rank computed alike (the same loss of the same
    [N]). ``anchors`` (tensors this rank computed in the pass) get zero gradients: every exchange of the pass is then
    on the backward's way even where no loss term reads this rank's rows."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, width: int, owner: torch.Tensor, slot: torch.Tensor, plan: CPPlan, *anchors: torch.Tensor
    ) -> Any:
        ctx.n, ctx.anchors = x.shape[0], [(a.shape, a.dtype, a.device) for a in anchors]
        owner, slot = owner.to(x.device), slot.to(x.device)
        ctx.mine = torch.nonzero(owner == plan.me).flatten()
        ctx.slots = slot[ctx.mine]
        buf = x.new_zeros((width,) + tuple(x.shape[1:]))
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in range(plan.G)]
        _collective(plan.cp, f"the all-gather of the logprobs of {plan.what}", lambda: _dist().all_gather(parts, buf, group=plan.group))
        plan.stats["received_bytes"] = plan.stats.get("received_bytes", 0) + (plan.G - 1) * buf.numel() * buf.element_size()
        return torch.stack(parts)[owner, slot]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        gx = g.new_zeros((ctx.n,) + tuple(g.shape[1:]))
        gx[ctx.slots] = g[ctx.mine]
        return (gx, None, None, None, None) + tuple(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.anchors)


class CPPlan:
    """The micro-batches of one context-parallel group, run by each of its ranks (``StepPlanRunner`` hands them here):
    the group's stack of ``_Part``s, pushes and pops split over the group (module docstring)."""

    def __init__(self, runner: Any, ranks: tuple[int, ...], chain: Callable[..., PackedBatch]) -> None:
        dist = _dist()
        if ranks not in _GROUPS:
            raise TreepackError(
                "E_ARG",
                f"no process group for cp_ranks {list(ranks)}: create the groups first on every rank (treepack.torch.cp_plan.make_groups, "
                "which run_step_plan calls)",
                field="cp_ranks",
            )
        if dist.get_rank() not in ranks:
            raise TreepackError(
                "E_INPUT",
                f"rank {dist.get_rank()} is not one of cp_ranks {list(ranks)}: the micro-batch is another group's "
                "(treepack.list_microbatches(dir, rank=r) lists a rank's own)",
                field="cp_ranks",
            )
        # runner: the StepPlanRunner (model, scoring settings, counters); chain: its chain-as-forest builder
        self.runner, self.ranks, self.group, self.chain = runner, ranks, _GROUPS[ranks], chain
        self.G, self.me = len(ranks), ranks.index(dist.get_rank())
        self.cp = ContextParallel(self.group, self.me, self.G, tuple(range(self.G + 1)))
        self.stack: list[_Part] = []
        self.stats: dict[str, int] = {}
        self.what = f"a micro-batch of context-parallel ranks {list(ranks)}"

    def fetch(self, x: torch.Tensor, route: Route, what: str) -> torch.Tensor:
        got: torch.Tensor = _Fetch.apply(x, route, self.cp, what, self.stats)
        return got

    def _join(self, batch: PackedBatch, op: Any) -> None:
        """Every rank of the group runs this micro-batch: a barrier that names a rank that does not come (gloo), then a
        fingerprint that names a rank that runs another one."""
        dist = _dist()
        _meet(self.group, self.ranks, self.what)
        se, ids = batch.subtree_end.to("cpu", torch.int64), batch.input_ids.to("cpu", torch.int64)
        w = torch.arange(1, se.shape[0] + 1, dtype=torch.int64)
        mine = torch.tensor(
            [batch.num_nodes, op.prefix_tokens, op.release, int((se * w).sum()), int((ids * w).sum()), hash(tuple(op.push)) & (2**62 - 1)]
        )
        dev = batch.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        parts = [torch.empty_like(mine, device=dev) for _ in range(self.G)]
        _collective(self.cp, f"the check that every rank runs {self.what}", lambda: dist.all_gather(parts, mine.to(dev), group=self.group))
        differ = [self.ranks[r] for r, p in enumerate(parts) if not torch.equal(p.cpu(), mine)]
        if differ:
            raise TreepackError(
                "E_INPUT",
                f"rank(s) {differ} of cp_ranks {list(self.ranks)} run another micro-batch than rank {self.ranks[self.me]} "
                "(N, prefix, tree or ids differ): every rank of the group runs the group's micro-batches in the plan's order",
                field="cp_ranks",
            )

    def _pass(self, forest: PackedBatch, parts: Sequence[_Part], bounds: tuple[int, ...], targets: torch.Tensor) -> Any:
        """Nodes [bounds[0], N) of ``forest`` (those below cached in ``parts``), this rank computing [bounds[me],
        bounds[me + 1]): what each layer caches for its rows, their final hidden states, the logprobs (entropies)
        of ``targets`` among them [n] (NaN elsewhere), their routing (``router=True``: per MoE layer the router logits
        [n, experts], and the experts [MoE layers, n, k]; else None); ``anchor`` ties every exchange of the pass to
        the results. A MoE model replays the routes ``forest.routes`` of the rows it computes."""
        r = self.runner
        lo, hi = bounds[self.me], bounds[self.me + 1]
        slots = _Slots(parts, bounds[0], bounds)
        se = forest.subtree_end.to("cpu", torch.int64)
        contexts = [_context(se, bounds[i]) if bounds[i + 1] > bounds[i] else se.new_zeros(0) for i in range(self.G)]
        dev = forest.device
        kv = route_rows([slots.of(c) for c in contexts], self.me, dev)
        # The parents, outside the rank's own range, of the nodes it scores.
        parent = forest.parent.to("cpu", torch.int64)

        def outside(i: int) -> torch.Tensor:
            t = targets[(targets >= bounds[i]) & (targets < bounds[i + 1])]
            p = parent[t]
            got: torch.Tensor = torch.unique(p[(p >= 0) & (p < bounds[i])])
            return got

        needs = [outside(i) for i in range(self.G)]
        hroute = route_rows([slots.of(x) for x in needs], self.me, dev)
        host = forest.to("cpu")
        a, b = (lo, hi) if hi > lo else (bounds[0], bounds[0] + 1)
        local = _local_forest(host, contexts[self.me], a, b)
        if hi == lo:  # nothing of this pass is this rank's: one throw-away root keeps it in every exchange
            local.parent[:] = -1
            local.position_ids[:] = 0
        local = local.to(dev)
        A = int(contexts[self.me].shape[0])
        mask = tree_mask(local, mode=r.attention, block_size=r.block_size)
        positions = forest.position_ids.to("cpu", torch.int64)
        windows: dict[int, tuple[Route, torch.Tensor]] = {}

        def windowed(w: int) -> tuple[Route, torch.Tensor]:
            # Per window size: the context keys each rank's rows see through it (window_context), routed like ``kv``.
            if w not in windows:
                seen = [
                    window_context(se, positions, bounds[i], bounds[i + 1], w) if len(contexts[i]) else contexts[i] for i in range(self.G)
                ]
                rows = torch.searchsorted(contexts[self.me], seen[self.me]).to(dev)
                windows[w] = (route_rows([slots.of(c) for c in seen], self.me, dev), rows)
            return windows[w]

        row = None if hi == lo else _Row(ContextParallel(self.group, self.me, self.G, bounds), se, self.stats)
        mask.prefix = hook = _Hook(self, parts, A, kv, self.what, windowed, row)
        replay: Any = contextlib.nullcontext()
        if forest.routes is not None or r.router:
            replay = replay_routes(r.model, None if forest.routes is None else forest.routes[:, a:b], tokens=b - a)
        with replay as routing:
            ids, pos = local.input_ids[None, A:], local.position_ids[None, A:]
            out = r.base(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
        hook.closed = True
        hidden = out.last_hidden_state[0]
        held = torch.cat([p.hidden for p in parts] + [hidden])
        got = self.fetch(held, hroute, f"the final hidden states of {self.what}")
        n = hi - lo
        context = hidden.new_zeros((A, hidden.shape[1])).index_copy(0, torch.searchsorted(contexts[self.me], needs[self.me]).to(dev), got)
        mine = targets[(targets >= lo) & (targets < hi)] - lo + A
        s = packed_logprobs(
            torch.cat([context, hidden]),
            local,
            chunk_size=r.chunk_size,
            nodes=mine,
            lm_head=r.head,
            entropy=r.entropy,
            temperature=r.temperature,
        )
        cache = {k: t[:, :, :n] for k, t in hook.captured.items()}
        ent = None if s.entropy is None else s.entropy[A : A + n]
        routed = None
        if r.router:
            whole = router_outputs(routing, r.model)
            r.router_meta = (whole.kinds, whole.aux_coef)
            routed = (tuple(t[:n] for t in whole.logits), whole.experts[:, :n])
        return cache, hidden[:n], s.logprobs[A : A + n], ent, routed, got.sum() + hidden.sum(), hook.kept

    def _segment(
        self, parts: Sequence[_Part], ids: torch.Tensor, pos: torch.Tensor, routes: torch.Tensor | None, start: int, bounds: tuple[int, ...]
    ) -> Any:
        """A segment's pass: chain depths [start, start + len(ids)) against ``parts`` below, each node scored from its
        parent (a root's logprob 0, as a rank's own segment); ``routes`` its nodes' (every part's below has them too)."""
        chain_routes = None if routes is None else torch.cat([cast(torch.Tensor, p.routes) for p in parts] + [routes], dim=1)
        chain = self.chain(torch.cat([p.ids for p in parts] + [ids]), torch.cat([p.pos for p in parts] + [pos]), chain_routes)
        cache, hidden, lp, ent, routed, anchor, kept = self._pass(chain, parts, bounds, torch.arange(max(start, 1), chain.num_nodes))

        def zero(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.nan_to_num(t, nan=0.0)

        return (cache, hidden, zero(lp), zero(ent), routed), anchor, kept

    def _ends(self, kept: dict[Any, tuple[torch.Tensor, int | None]], bounds: tuple[int, ...], grads: Any = None) -> Any:
        """A pushed segment's recurrent ends, on every rank: per layer call the state after its last node (the last
        rank's, "from last") and its last min(K - 1, length) convolution inputs (each rank's own columns), summed
        over the group; with ``grads`` (the part's leaves' gradients, by key) the pop's pairs instead: the group's
        summed gradients, of the state on the last rank and of each rank's own columns on it."""
        if not kept:
            return ({}, {}) if grads is None else []
        dist, start, end = _dist(), bounds[0], bounds[-1]
        keys = sorted(kept)
        owner = int(torch.searchsorted(torch.tensor(bounds[1:]), torch.tensor(end - 1), right=True))
        lo, hi = bounds[self.me], bounds[self.me + 1]
        # K - 1 per convolution: a rank whose range is empty ran its throw-away root outside cp_recurrent (no width)
        width = torch.tensor([float(kept[k][1] or 0) for k in keys], dtype=torch.float64, device=kept[keys[0]][0].device)
        what = f"the convolution widths of {self.what}"
        _collective(self.cp, what, lambda: dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.group))
        outs, own = [], {}
        for k, w in zip(keys, width.tolist()):
            t, _ = kept[k]
            if k[1] == "state":
                outs.append(t if self.me == owner else torch.zeros_like(t))
                continue
            n = min(int(w), end - start)
            buf = t.new_zeros((1, t.shape[1], n))
            a = max(hi - int(t.shape[2]), end - n)  # this rank's columns among the last n depths
            if hi > lo and hi > a:
                own[k] = (slice(t.shape[2] - (hi - a), t.shape[2]), slice(a - (end - n), hi - (end - n)))
                buf[:, :, own[k][1]] = t[:, :, own[k][0]]
            outs.append(buf)
        if grads is not None:
            outs = [torch.zeros_like(o) if grads[k] is None else grads[k] for k, o in zip(keys, outs)]
        flat = torch.cat([o.detach().flatten() for o in outs])
        _collective(self.cp, f"the recurrent ends of {self.what}", lambda: dist.all_reduce(flat, group=self.group))
        got, at = {}, 0
        for k, o in zip(keys, outs):
            got[k] = flat[at : at + o.numel()].view_as(o)
            at += o.numel()
        if grads is None:
            return {k: v for k, v in got.items() if k[1] == "state"}, {k: v for k, v in got.items() if k[1] != "state"}
        pairs = [(kept[k][0], got[k]) for k in keys if k[1] == "state" and self.me == owner]
        return pairs + [(kept[k][0][:, :, a], got[k][:, :, b]) for k, (a, b) in own.items()]

    def _push(self, batch: PackedBatch, end: int) -> None:
        start = self.stack[-1].end if self.stack else 0
        ids, pos = batch.input_ids[start:end], batch.position_ids[start:end]
        routes = None if batch.routes is None else batch.routes[:, start:end]
        bounds = split_bounds(torch.full((end,), end), start, self.G)
        with torch.no_grad():
            got, _, kept = self._segment(self.stack, ids, pos, routes, start, bounds)
            states, tails = self._ends(kept, bounds)
        part = _Part(start, bounds, ids, pos, routes, got)
        part.states = {k: t.detach().requires_grad_() for k, t in states.items()}
        part.tails = {k: t.detach().requires_grad_() for k, t in tails.items()}
        self.stack.append(part)
        r = self.runner
        r.pushed += bounds[self.me + 1] - bounds[self.me]
        r.peak_tokens = max(r.peak_tokens, self.stack[-1].end)
        r.peak_bytes = max(r.peak_bytes, sum(p.nbytes() for p in self.stack))

    def _pop(self) -> None:
        part = self.stack.pop()
        (cache, hidden, lp, ent, routed), anchor, kept = self._segment(self.stack, part.ids, part.pos, part.routes, part.start, part.bounds)
        leaves = {**part.states, **part.tails}
        ends = self._ends(kept, part.bounds, {k: t.grad for k, t in leaves.items()})
        pairs = [(cache[k], t) for k, t in part.cache.items()] + [(hidden, part.hidden), (cast(torch.Tensor, lp), part.lp)]
        if ent is not None and part.ent is not None:
            pairs.append((ent, part.ent))
        if routed is not None and part.router_logits is not None:
            pairs += list(zip(routed[0], part.router_logits))
        # Every rank back-propagates through the same exchanges; a leaf nobody read counts as zeros.
        grads = [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for _, leaf in pairs] + [g for _, g in ends]
        torch.autograd.backward([t for t, _ in pairs + ends] + [anchor], grads + [torch.zeros_like(anchor)])
        self.runner.computed += part.rows(self.me)

    def forward(self, batch: PackedBatch, op: Any) -> NodeScores:
        """The group's micro-batch on this rank (``StepPlanRunner.forward``'s contract): its pushes, this rank's share of
        its nodes, and the whole micro-batch's ``NodeScores`` [N] (every rank's alike)."""
        self._join(batch, op)
        self.runner._check(batch, op, self.stack)
        for end in op.push:
            self._push(batch, end)
        h, N = op.prefix_tokens, batch.num_nodes
        targets = scored_nodes(batch).cpu()
        if N == 0:
            empty = torch.zeros(0, dtype=torch.float64)
            return NodeScores(empty, empty if self.runner.entropy else None, targets)
        r, anchors = self.runner, []
        bounds = split_bounds(batch.subtree_end.to("cpu", torch.int64), h, self.G) if N > h else (h,) * (self.G + 1)
        # This rank's rows (its parts', then those it computes) as columns: logprobs, entropies, each MoE layer's router
        # logits; and the experts used [rows, MoE layers * k] (with router=True).
        rows: list[list[torch.Tensor]] = [[p.lp[:, None]] for p in self.stack]
        experts = [p.experts for p in self.stack]
        for p, row in zip(self.stack, rows):
            row += [cast(torch.Tensor, p.ent)[:, None]] if r.entropy else []
            row += [] if p.router_logits is None else p.router_logits
        if N > h:
            _, _, lp, ent, routed, anchor, _ = self._pass(batch, self.stack, bounds, targets[targets >= h])
            rows.append([lp[:, None]] + ([] if ent is None else [ent[:, None]]) + ([] if routed is None else list(routed[0])))
            experts.append(None if routed is None else routed[1])
            anchors.append(anchor)
            r.computed += bounds[self.me + 1] - bounds[self.me]
        if r.router and any(e is None for e in experts):
            raise TreepackError("E_ARG", "a cached prefix was pushed without its router logits (router=False)", field="router")
        x = torch.cat([torch.cat(row, dim=1) for row in rows])
        slots = _Slots(self.stack, h, bounds)
        owner, slot = slots.of(torch.arange(N))
        width = max(slots.offsets[-1][i] + bounds[i + 1] - bounds[i] for i in range(self.G))
        whole: torch.Tensor = _Assemble.apply(x, width, owner, slot, self, *anchors)
        k = 2 if r.entropy else 1
        scored = torch.zeros(N, dtype=torch.bool)
        scored[targets] = True
        scores = torch.where(scored[:, None].to(whole.device), whole[:, :k], torch.full_like(whole[:, :k], float("nan")))
        router = None
        if r.router:
            mine = torch.cat(cast(list[torch.Tensor], experts), dim=1)  # [MoE layers, rows, k]
            L, _, topk = mine.shape
            used = _Assemble.apply(mine.permute(1, 0, 2).reshape(-1, L * topk), width, owner, slot, self)
            logits = whole[:, k:].chunk(L, dim=1)  # the MoE layers' [N, experts] each
            kinds, coef = cast(tuple[tuple[str, ...], float | None], r.router_meta)
            router = RouterOutputs(tuple(logits), used.reshape(N, L, topk).permute(1, 0, 2), kinds, coef)
        return NodeScores(scores[:, 0], scores[:, 1] if r.entropy else None, targets, router)

    def release(self, count: int) -> None:
        """``count`` pops (the micro-batch forwarded last's ``prefix_release``), every rank of the group together."""
        for _ in range(count):
            self._pop()
        self.runner.exchanged += self.stats.pop("received_bytes", 0)  # what this micro-batch's exchanges brought in


__all__ = ["CPPlan", "make_groups", "split_bounds"]
