"""Shared prefixes executed in shares (docs/design.md §11): a prefix piece whose branches train on several
data-parallel ranks is computed once by those ranks together, each its ``ranges[i]`` of the piece's depths.

The manifest's ``shared_prefixes`` list the pieces; a micro-batch's ``prefix_shared`` marks which of its pushed
segments are pieces. ``run_step_plan(..., shared_prefixes=pieces)`` (every rank passing the same list, the pieces of
the window its micro-batches make) runs them so:

1. before the window's first micro-batch, for each piece in list order, its members compute it without grad, rank i
   of the group its range [a, b) as the queries of a context-parallel forward (the exchange of
   python/treepack/torch/context_parallel.py: in every attention layer the keys/values of the ranges before it are
   fetched from their owners, a sliding-window layer's only those within its window of the range, and put after
   those of the pieces above it, which every member holds); each member scores the nodes whose parent row it
   computed; then the group all-gathers the piece's per-layer keys/values, the node scores and the final hidden rows
   some member's micro-batches read (``hidden_reads``), so that each holds the whole piece as an ordinary cached
   segment;
2. a micro-batch's push of a piece takes the held segment instead of computing it, and its pop drops it without
   recomputation: the gradients of the piece's leaves (keys/values, hidden states, node logprobs) accumulate on the
   rank over the window;
3. after the window's last micro-batch, for each piece in reverse list order, every member recomputes its range
   with grad (the same forward, the keys/values before it fetched again), all-gathers it again and back-propagates
   its own leaves' gradients through the gather: the gather's backward sums the members' gradients and returns each
   range's share to the rank that computed it, and the fetch's backward returns the gradients of the keys/values of
   the ranges before to their owners; the gradients reaching the pieces above accumulate there for their turn.

Each member thus computes its range twice (pushed, then popped with grad): ``computed_tokens`` counts the piece
once per group, as the manifest does. A rank's parameter gradients are then its share: summed over the
data-parallel ranks (DDP's all-reduce, or ``reduce_gradients``) they equal the run of every micro-batch in one
process. Every collective runs under the process group's timeout: a member that fails makes the others raise
TreepackError (E_BACKEND) naming the piece and the exchange.

Every family the step plan runs: in a recurrent layer (Gated DeltaNet, Mamba2, KDA) each range starts from the state
and the convolution inputs the member before hands over (``GroupPrefix``, with python/treepack/torch/cp_recurrent.py's
point-to-point messages, their gradients returned in the backward), and every member ends holding the last member's
final state and convolution tail, what a pushed segment holds; a routed piece replays its nodes' routes, and with
``router=True`` its router logits are gathered like the keys/values (``Share.routing``), leaves whose gradients
return to their ranges; a vision-language member encodes the images that fill a node of its range. Gradient
checkpointing on a recurrent model is refused (its recomputation would run the hand-overs again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..microbatch import TreepackError
from .attention import module_window
from .batch import PackedBatch
from .context_parallel import ContextParallel, Route, _collective, _Fetch, _route, fetch_keys_values, in_rows
from .cp_recurrent import _Comm, _Recv, _Send

# Process groups of the pieces' rank lists, created on every rank in the same order (dist.new_group's contract).
_GROUPS: dict[tuple[int, ...], Any] = {}


@dataclass(frozen=True)
class Piece:
    """One entry of the manifest's ``shared_prefixes``: chain depths [start, end) held by ``ranks``, rank
    ``ranks[i]`` computing depths ``ranges[i]``."""

    id: int
    start: int
    end: int
    ranks: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, entry: Mapping[str, Any], index: int) -> Piece:
        """A manifest entry (``treepack.read_manifest`` checked its fields)."""
        try:
            p = cls(
                int(entry["id"]),
                int(entry["start"]),
                int(entry["end"]),
                tuple(int(r) for r in entry["ranks"]),
                tuple((int(a), int(b)) for a, b in entry["ranges"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TreepackError("E_INPUT", f"shared_prefixes[{index}] is not a piece ({e})", field=f"shared_prefixes[{index}]") from None
        cuts = [p.start] + [b for _, b in p.ranges]
        if len(p.ranks) < 2 or len(p.ranges) != len(p.ranks) or [a for a, _ in p.ranges] != cuts[:-1] or cuts[-1] != p.end:
            raise TreepackError(
                "E_INPUT",
                f"shared_prefixes[{index}]: ranges {list(p.ranges)} must cover [{p.start}, {p.end}) in order, one per rank of "
                f"{list(p.ranks)}",
                field=f"shared_prefixes[{index}].ranges",
            )
        if any(b <= a for a, b in p.ranges):
            raise TreepackError(
                "E_INPUT", f"shared_prefixes[{index}]: every rank's range must be non-empty", field=f"shared_prefixes[{index}].ranges"
            )
        return p


def group_of(ranks: tuple[int, ...]) -> Any:
    import torch.distributed as dist

    if ranks not in _GROUPS:
        # new_group's own default is 30 minutes: a group waits on a failed rank as long as the default group does
        _GROUPS[ranks] = dist.new_group(list(ranks), timeout=world_timeout())
    return _GROUPS[ranks]


def world_timeout() -> Any:
    """The default process group's timeout (``init_process_group(timeout=...)``), or None where the backend hides it."""
    import torch.distributed as dist

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        with contextlib.suppress(RuntimeError, AttributeError):
            return None if world is None else world._get_backend(torch.device(device)).options._timeout
    return None


def captured_layer(prefix: Any, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, who: str) -> int:
    """The layer index of an attention call under ``prefix`` (a TreepackError saying ``who`` cannot name the keys of
    a layer without one), its keys and values kept (``prefix.keep``)."""
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise TreepackError("E_ARG", f"{type(module).__name__} has no layer_idx: {who} cannot name its keys", field="layer_idx")
    prefix.keep(("key", layer), key)
    prefix.keep(("value", layer), value)
    return layer


class Share:
    """This rank's part of one piece: its place ``cp`` in the group (bounds relative to the piece's start), the routes
    of the keys/values before its range (``before``), of the whole piece (``every``) and of the node scores
    (``scored``: member i scores nodes [lo, hi), those whose parent row it computes, the first member also the piece's
    first node from the row below) and of the final hidden rows the members' micro-batches read (``hidden``, to
    ``hidden_rows``: ``reads``, this rank's, all-gathered over the group; every row when None), the micro-batch whose
    chain holds the piece's tokens, and the pieces below it on that chain."""

    def __init__(
        self, piece: Piece, group: Any, rank: int, source: PackedBatch, below: list[int], reads: torch.Tensor | None = None
    ) -> None:
        self.piece, self.source, self.below = piece, source, below
        i = piece.ranks.index(rank)
        self.a, self.b = piece.ranges[i]
        bounds = tuple(a - piece.start for a, _ in piece.ranges) + (piece.end - piece.start,)
        self.cp = ContextParallel(group, i, len(piece.ranks), bounds)
        dev = source.device
        G, L = len(piece.ranks), piece.end - piece.start
        self.before: Route = _route([torch.arange(bounds[r]) for r in range(G)], bounds, i, dev)
        self.every: Route = _route([torch.arange(L)] * G, bounds, i, dev)
        # Node j's score reads row j - 1: member i's scores are nodes [a_i + 1, b_i + 1), the first's from the start.
        cuts = (0,) + tuple(a - piece.start + 1 for a, _ in piece.ranges[1:]) + (L,)
        self.lo, self.hi = piece.start + cuts[i], piece.start + cuts[i + 1]
        self.scored: Route = _route([torch.arange(L)] * G, cuts, i, dev)
        self.stats: dict[str, int] = {}
        self.length = L
        self.from_last: dict[int, Route] = {}  # n -> the route of n rows every member fetches from the last
        # What the received states' autograd nodes hang from (cp_recurrent's _Recv needs an input that takes a gradient).
        self.anchor = torch.zeros((), device=dev, requires_grad=True)
        wanted = [torch.arange(L)] * G if reads is None else self._read_by_each(reads)
        self.hidden: Route = _route(wanted, bounds, i, dev)
        self.hidden_rows = wanted[i].to(dev)
        self.windows: dict[int, tuple[Route, torch.Tensor]] = {}

    def _read_by_each(self, reads: torch.Tensor) -> list[torch.Tensor]:
        """Every member's rows read (bool [L] each), all-gathered: one small message per piece."""
        import torch.distributed as dist

        device = self.source.device if dist.get_backend(self.cp.group) == "nccl" else torch.device("cpu")
        mine = reads.to(device, torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.cp.size)]
        where = f"the all-gather of the rows read of shared piece {self.piece.id} (data-parallel ranks {list(self.piece.ranks)})"
        _collective(self.cp, where, lambda: dist.all_gather(parts, mine, group=self.cp.group))
        self.stats["received_bytes"] = self.stats.get("received_bytes", 0) + (self.cp.size - 1) * mine.numel()
        return [torch.nonzero(p.cpu()).flatten() for p in parts]

    def gather_read(self, hidden: torch.Tensor, what: str) -> torch.Tensor:
        """The piece's final hidden states [L, D] from every member's range: the rows some member's micro-batches read
        (``hidden_rows``), zeros elsewhere; differentiable like ``gather``."""
        got = self.fetch(hidden, self.hidden, what)
        return got.new_zeros((self.piece.end - self.piece.start, got.shape[1])).index_copy(0, self.hidden_rows, got)

    def window_route(self, window: int) -> tuple[Route, torch.Tensor]:
        """The route of the keys before its range that a sliding-window layer's queries of the range can see, and their
        rows in [0, a - start): a chain's, so those within ``window`` positions of the range's least position."""
        got = self.windows.get(window)
        if got is None:
            b, pos = self.cp.bounds, self.source.position_ids[self.piece.start : self.piece.end].cpu()
            needs = [torch.arange(b[r])[pos[b[r] : b[r + 1]].min() - pos[: b[r]] < window] for r in range(self.cp.size)]
            dev = self.source.device
            got = self.windows[window] = (_route(needs, b, self.cp.rank, dev), needs[self.cp.rank].to(dev))
        return got

    def fetch(self, x: torch.Tensor, route: Route, what: str) -> torch.Tensor:
        where = f"{what} of shared piece {self.piece.id} (data-parallel ranks {list(self.piece.ranks)})"
        got: torch.Tensor = _Fetch.apply(x, route, self.cp, where, self.stats)
        return got

    def comm(self, key: Any) -> _Comm:
        """The point-to-point messages of one recurrent layer call between neighbouring members (cp_recurrent's)."""
        where = f"shared piece {self.piece.id} (data-parallel ranks {list(self.piece.ranks)}), {key[0]}"
        return _Comm(self, key, where)  # type: ignore[arg-type]  # reads .cp and .stats, as on a LocalPart

    def last(self, rows: torch.Tensor, n: int, what: str) -> torch.Tensor:
        """The last member's ``rows`` [n, ...] on every member (the others pass [0, ...]), differentiable: the
        backward sums the members' gradients into the last member's."""
        if n not in self.from_last:
            G = self.cp.size
            self.from_last[n] = _route([torch.arange(n)] * G, (0,) * G + (n,), self.cp.rank, rows.device)
        return self.fetch(rows, self.from_last[n], what)

    def routing(self, routing: Any) -> PieceRouting:
        """The whole piece's routing from this member's range's (``moe.Routing``): every MoE layer's router logits
        (differentiable, as ``gather``) and the experts used."""
        logits = tuple(self.gather(t, f"MoE layer {i}'s router logits") for i, t in enumerate(routing.logits))
        experts = self.gather(routing.experts().transpose(0, 1), "the experts used").transpose(0, 1)
        return PieceRouting(logits, experts)

    def gather(self, t: torch.Tensor, what: str, route: Route | None = None) -> torch.Tensor:
        """The whole piece's ``t`` from every member's range (the range's nodes on dim 2 of a layer's cache, dim 0 of
        hidden states and scores; ``route`` default ``every``): differentiable, its backward summing the members'
        gradients into each range's owner."""
        dim = 2 if t.dim() == 4 else 0
        rows = t.movedim(dim, 0)
        got = self.fetch(rows.reshape(rows.shape[0], -1), self.every if route is None else route, what)
        return got.reshape((got.shape[0],) + tuple(rows.shape[1:])).movedim(0, dim)


class PieceRouting:
    """A shared piece's routing as a held segment keeps it (the ``moe.Routing`` fields it reads): per MoE layer the
    router logits [piece tokens, experts], and the experts used [MoE layers, piece tokens, k]."""

    def __init__(self, logits: tuple[torch.Tensor, ...], experts: torch.Tensor) -> None:
        self.logits, self._experts = logits, experts

    def experts(self) -> torch.Tensor:
        return self._experts


class _Neighbours:
    """A ``StatePlan``'s message lists (what cp_recurrent's ``_Recv`` and ``_Send`` read) for one neighbour."""

    def __init__(self, recv: list[tuple[int, int]], send: list[tuple[int, None]]) -> None:
        self.recv, self.send = recv, send


class GroupPrefix:
    """Set as ``prefix`` on the chain's TreeMask for one member's forward of its range [a, b) (the step plans' hook in
    ``tree_attention`` and the recurrent layers'): before its own keys/values come those of the pieces below (held)
    and of the piece's ranges before a (fetched from their owners, one message per layer; a sliding-window layer's
    only those its range's queries can see, the others left zero rows). A recurrent layer call starts from the state
    after node a - 1 and reads the convolution inputs before a: the member before hands them over (``_receive``),
    each member handing the next its own (``hand_over``) as the layers of a row split by context parallelism do
    (python/treepack/torch/cp_recurrent.py), their gradients returning the same way; the pieces below give the first
    member its start. The last member's final state and convolution tail are the piece's, which every member then
    holds (``whole``)."""

    def __init__(self, stack: Sequence[Any], share: Share) -> None:
        self.stack, self.share, self.rows = stack, share, share.a
        self.captured: dict[Any, torch.Tensor] = {}
        self.closed = False
        self.received: dict[Any, torch.Tensor] = {}  # by recurrent call key: what the member before handed over
        self.widths: dict[Any, int | None] = {}  # by recurrent call key: the convolution's K - 1, None for a state
        self.ends: dict[Any, torch.Tensor] = {}  # on the last member: the piece's final convolution inputs and states

    def keep(self, key: Any, tensor: torch.Tensor) -> None:
        if not self.closed:
            self.captured[key] = tensor

    def extend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        layer = captured_layer(self, module, key, value, "shared pieces")
        window = module_window(module)
        if window is None:
            kc, vc = fetch_keys_values(key, value, lambda x: self.share.fetch(x, self.share.before, f"layer {layer}'s keys/values"))
        else:
            route, rows = self.share.window_route(window)
            what = f"layer {layer}'s keys/values in its window"
            fetched = fetch_keys_values(key, value, lambda x: self.share.fetch(x, route, what))
            kc, vc = in_rows(fetched, rows, self.rows - self.share.piece.start)
        k = torch.cat([s.cache[("key", layer)] for s in self.stack] + [kc, key], dim=2)
        v = torch.cat([s.cache[("value", layer)] for s in self.stack] + [vc, value], dim=2)
        q = torch.cat([query.new_zeros(query.shape[:2] + (self.rows, query.shape[3])), query], dim=2)
        return q, k, v

    def tail(self, key: Any, t: int) -> torch.Tensor:
        """The convolution inputs of the chain's last t nodes before a [1, C, t]: the pieces below hold theirs, the
        member before hands over the last K - 1 of this piece's."""
        cols = [s.cache[key] for s in self.stack] + ([self._receive(key)] if self.share.cp.rank else [])
        return torch.cat(cols, dim=2)[:, :, -t:]

    def state(self, key: Any) -> torch.Tensor:
        """The recurrent state after node a - 1 [1, ...]: the member before's, or the top piece below's."""
        return self._receive(key) if self.share.cp.rank else self.stack[-1].cache[key]

    def _receive(self, key: Any) -> torch.Tensor:
        got = self.received.get(key)
        if got is None:
            plan = _Neighbours([(self.share.cp.rank - 1, 1)], [])
            got = self.received[key] = _Recv.apply(self.share.anchor, plan, self.share.comm(key))
        return got

    def hand_over(self, key: Any, out: torch.Tensor, width: int | None) -> torch.Tensor:
        """After a recurrent layer call (recurrent.py): its state after this range, or the piece's last ``width``
        convolution inputs so far, go to the next member, tied to the call's output ``out`` so that their gradient
        comes back when ``out``'s does; the last member keeps them as the piece's."""
        if self.closed:
            raise TreepackError(
                "E_ARG",
                "a recurrent layer ran again after the forward (gradient checkpointing?): a shared piece's state hand-overs run "
                "once per forward",
                field="gradient_checkpointing",
            )
        self.widths[key] = width
        own = self.captured[key]
        if width is not None and key in self.received:
            own = torch.cat([self.received[key].to(own.dtype), own], dim=2)[:, :, -width:]
        cp = self.share.cp
        if cp.rank == cp.size - 1:
            self.ends[key] = own
            return out
        sent: torch.Tensor = _Send.apply(out, _Neighbours([], [(cp.rank + 1, None)]), self.share.comm(key), own)
        return sent

    def whole(self, cache: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """What every member holds of the piece, from what this member's forward captured: each attention layer's
        keys/values of every range, each recurrent call's final state and last K - 1 convolution inputs (the last
        member's)."""
        out = {}
        last = self.share.cp.rank == self.share.cp.size - 1
        for k, t in cache.items():
            if k not in self.widths:
                out[k] = self.share.gather(t, f"layer {k[1]}'s {k[0]}s")
                continue
            width, what = self.widths[k], f"{k[0]}'s final {k[1]}"
            if width is None:  # a state [1, ...]
                rows = (self.ends[k] if last else t).reshape(1, -1)
                out[k] = self.share.last(rows if last else rows[:0], 1, what).reshape(t.shape)
            else:  # convolution inputs [1, C, n] as rows [n, C]
                n = min(width, self.share.length)
                rows = (self.ends[k] if last else t)[0].t()
                out[k] = self.share.last(rows if last else rows[:0], n, what).t()[None]
        return out


def plan_shares(
    pieces: Sequence[Piece], batches: Sequence[PackedBatch], ops: Sequence[Any], rank: int
) -> dict[int, tuple[PackedBatch, list[int], torch.Tensor]]:
    """For each piece this rank holds: the first of its micro-batches that pushes it, the pieces below it on the
    stack then (all of them pieces: a rank's own segments cannot lie under a piece its group computes) and the rows of
    its final hidden states this rank reads (bool [end - start]: ``hidden_reads``). Refuses a plan whose pushes
    disagree with the pieces."""
    by_id = {p.id: p for p in pieces}
    found: dict[int, tuple[PackedBatch, list[int], torch.Tensor]] = {}
    stack: list[tuple[int, int | None]] = []  # (end depth, piece id or None)
    for n, (batch, op) in enumerate(zip(batches, ops)):
        for j, end in enumerate(op.push):
            pid = op.shared[j] if op.shared else None
            start = stack[-1][0] if stack else 0
            if pid is not None:
                p = by_id.get(pid)
                field = "prefix_shared"
                if p is None:
                    raise TreepackError(
                        "E_INPUT", f"micro-batch {n} pushes shared piece {pid}, which shared_prefixes does not list", field=field
                    )
                if rank not in p.ranks or (p.start, p.end) != (start, end):
                    raise TreepackError(
                        "E_INPUT",
                        f"micro-batch {n} pushes depths [{start}, {end}) as shared piece {pid}, which is [{p.start}, {p.end}) on ranks "
                        f"{list(p.ranks)} (this is rank {rank})",
                        field=field,
                    )
                below = [q for _, q in stack]
                if any(q is None for q in below):
                    raise TreepackError(
                        "E_INPUT",
                        f"shared piece {pid} lies above a segment rank {rank} computes alone: its group cannot compute it in shares",
                        field=field,
                    )
                found.setdefault(pid, (batch, [int(q) for q in below if q is not None], torch.zeros(p.end - p.start, dtype=torch.bool)))
            stack.append((end, pid))
        for pid in {q for _, q in stack if q is not None and q in found}:
            hidden_reads(by_id[pid], batch, op.prefix_tokens, found[pid][2])
        del stack[len(stack) - min(op.release, len(stack)) :]
    missing = [p.id for p in pieces if rank in p.ranks and p.id not in found]
    if missing:
        raise TreepackError(
            "E_INPUT",
            f"rank {rank} is a member of shared pieces {missing} but none of its micro-batches pushes them (pass each rank its "
            "micro-batches of the window the pieces belong to)",
            field="shared_prefixes",
        )
    return found


def hidden_reads(piece: Piece, batch: PackedBatch, h: int, reads: torch.Tensor) -> None:
    """Marks in ``reads`` the rows of ``piece``'s final hidden states that ``batch`` (its cached chain [0, h) holding
    the piece) reads (docs/design.md §9: a node's score is read from its parent's row): the parents in the piece of
    its computed nodes, and the piece's last row when a segment lies above it (its first node's parent)."""
    p = batch.parent[h:].cpu()
    inside = p[(p >= piece.start) & (p < piece.end)]
    reads[inside - piece.start] = True
    if h > piece.end:
        reads[piece.end - piece.start - 1] = True


__all__ = ["GroupPrefix", "Piece", "Share", "group_of", "hidden_reads", "plan_shares"]
