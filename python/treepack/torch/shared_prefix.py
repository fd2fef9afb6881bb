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

Attention layers only for now: a model with recurrent layers (whose state would pass from range to range), routes
(MoE replay) or images is refused here; it runs the plan with ``shared_prefixes=None``, each rank computing the
pieces it holds itself (the same results, the cost of the plan without sharing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..microbatch import TreepackError
from .attention import module_window
from .batch import PackedBatch
from .context_parallel import ContextParallel, Route, _collective, _Fetch, _route, fetch_keys_values, in_rows

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
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


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

    def gather(self, t: torch.Tensor, what: str, route: Route | None = None) -> torch.Tensor:
        """The whole piece's ``t`` from every member's range (the range's nodes on dim 2 of a layer's cache, dim 0 of
        hidden states and scores; ``route`` default ``every``): differentiable, its backward summing the members'
        gradients into each range's owner."""
        dim = 2 if t.dim() == 4 else 0
        rows = t.movedim(dim, 0)
        got = self.fetch(rows.reshape(rows.shape[0], -1), self.every if route is None else route, what)
        return got.reshape((got.shape[0],) + tuple(rows.shape[1:])).movedim(0, dim)


class GroupPrefix:
    """Set as ``prefix`` on the chain's TreeMask for one member's forward of its range [a, b) (the step plans' hook in
    ``tree_attention``): before its own keys/values come those of the pieces below (held) and of the piece's ranges
    before a (fetched from their owners, one message per layer; a sliding-window layer's only those its range's
    queries can see, the others left zero rows)."""

    def __init__(self, stack: Sequence[Any], share: Share) -> None:
        self.stack, self.share, self.rows = stack, share, share.a
        self.captured: dict[Any, torch.Tensor] = {}
        self.closed = False

    def keep(self, key: Any, tensor: torch.Tensor) -> None:
        if not self.closed:
            self.captured[key] = tensor

    def extend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise TreepackError("E_ARG", f"{type(module).__name__} has no layer_idx: shared pieces cannot name its keys", field="layer_idx")
        self.keep(("key", layer), key)
        self.keep(("value", layer), value)
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
        raise TreepackError("E_ARG", "shared pieces in shares carry attention keys/values only (recurrent layers: not yet)", field="model")

    state = tail


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
