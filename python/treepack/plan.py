"""Micro-batches for a trainer in Python: which sequences go together, keeping each group (a GRPO group, an agent
episode) whole, under a budget of packed tokens, with the counts a trainer normalises by.

    >>> seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8, 9], [7, 8]]
    >>> masks = [[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1]]
    >>> plan = plan_micro_batches(seqs, max_tokens=6, groups=["a", "a", "a", "b", "b"], loss_masks=masks)
    >>> for mb in plan.micro_batches:        # group a: 6 distinct prefixes; b: 3; together over the budget
    ...     print(mb.sequences.tolist(), mb.groups, mb.packed_tokens, mb.trainable_tokens, mb.num_sequences)
    [0, 1, 2] ['a'] 6 6 3
    [3, 4] ['b'] 3 3 2
    >>> plan.trainable_tokens, plan.num_sequences      # the step's global normalisers (token-mean, seq-mean)
    (9, 5)

The packed tokens of a set of sequences are the distinct prefixes among them (the nodes of their forest). Groups
are laid out in the order of the window's forest (one ``pack_sequences`` call: groups that share a prompt are
adjacent), and micro-batches are contiguous runs of that order: a cut between two groups repeats only the prefix
they share. The cuts are those of the TypeScript planner (src/pack/budget.ts, docs/design.md): the fewest
micro-batches within the budget (rounded up to a multiple of ``dp``), then, of all the cuts into that many runs, the
ones that repeat the fewest prefix tokens (a dynamic program over the cuts, ties to the latest cut). With ``dp`` > 1
or a fixed ``num_micro_batches``, each run is first held within 3% of the smallest largest run that many runs allow,
as the TypeScript planner holds its cost. With single-sequence groups and ``dp`` = 1 the two planners give the same
micro-batches (test/python-plan.test.ts holds them equal); the unit here is a whole group, and the cost model, the
rank balancing and its refinement stay in TypeScript (``treepack pack`` for a stored window): micro-batch i runs on
rank ``i % dp``.

A group that alone exceeds ``max_tokens`` is refused (TreepackError naming the group): splitting it would change
per-group normalisers and lose its sharing, and giving it an over-budget micro-batch would break the memory bound
the budget stands for.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .microbatch import TreepackError
from .pack import pack_sequences


@dataclass
class MicroBatchPlan:
    """One planned micro-batch: ``sequences`` (indices into the window's sequences, ascending), its ``groups`` in plan
    order, packed, naive and trainable token counts, and where it runs: ``rank`` and ``step`` (0-based on its rank)."""

    sequences: np.ndarray  # int64, indices into the window's sequences, ascending
    groups: list[Hashable]  # in plan order
    packed_tokens: int
    naive_tokens: int
    trainable_tokens: int
    num_sequences: int
    rank: int
    step: int  # on its rank, 0-based


@dataclass
class Plan:
    """A window's plan: ``micro_batches`` step-major (step 0 of ranks 0..dp-1, then step 1, ...), their summed
    ``packed_tokens``, ``optimum_tokens`` (the window as one forest: the lower bound of any split), and the step's
    naive and trainable tokens (what a global token-mean divides by) and sequences."""

    micro_batches: list[MicroBatchPlan]  # step-major: step 0 of ranks 0..dp-1, then step 1, …
    packed_tokens: int  # Σ over micro-batches
    optimum_tokens: int  # the window as one forest: the lower bound of any split
    naive_tokens: int
    trainable_tokens: int  # the step's: what a global token-mean divides by
    num_sequences: int


# Slack on the smallest largest run with dp > 1 or a fixed count: room to move cuts to shallow points (COST_SLACK of
# src/pack/budget.ts).
COST_SLACK = 0.03


def _positive(name: str, v: int | None) -> int | None:
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {v!r}", field=name)
    return v


class _Runs:
    """The groups in forest order with their nodes; packed tokens of contiguous runs, counted with one mark array."""

    def __init__(self, unit_nodes: list[np.ndarray], num_nodes: int):
        self.nodes = unit_nodes
        self.mark = np.zeros(num_nodes, dtype=bool)

    def cuts(self, limit: float) -> list[int]:
        """Run ends of the greedy split under ``limit`` packed tokens (the fewest runs); every unit fits alone (the
        callers' limits are at least the largest unit)."""
        ends: list[int] = []
        used: list[np.ndarray] = []
        cur = 0
        for u, nodes in enumerate(self.nodes):
            new = int(np.count_nonzero(~self.mark[nodes]))
            if cur and cur + new > limit:
                ends.append(u)
                for n in used:
                    self.mark[n] = False
                used, cur = [], 0
                new = len(nodes)
            if new > limit:
                raise ValueError(f"unit {u} alone packs to {new} tokens, over the limit {limit}")
            self.mark[nodes] = True
            used.append(nodes)
            cur += new
        for n in used:
            self.mark[n] = False
        return ends + [len(self.nodes)]

    def tokens(self, a: int, b: int) -> int:
        return len(np.unique(np.concatenate(self.nodes[a:b]))) if b > a else 0

    def windows(self, limit: float) -> list[np.ndarray]:
        """For each run end j (1..U), the packed tokens of runs [i, j) for i = j-1, j-2, ... while within ``limit``
        (at least the unit alone): entry k is run [j-1-k, j)."""
        out = []
        for j in range(1, len(self.nodes) + 1):
            sizes: list[int] = []
            cur, i = 0, j - 1
            while i >= 0:
                new = int(np.count_nonzero(~self.mark[self.nodes[i]]))
                if sizes and cur + new > limit:
                    break
                self.mark[self.nodes[i]] = True
                cur += new
                sizes.append(cur)
                i -= 1
            for u in range(i + 1, j):
                self.mark[self.nodes[u]] = False
            out.append(np.array(sizes, dtype=np.float64))
        return out


def plan_micro_batches(
    sequences: Sequence[Sequence[int]],
    max_tokens: int | None = None,
    groups: Sequence[Hashable] | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
    num_micro_batches: int | None = None,
    dp: int = 1,
) -> Plan:
    """Micro-batches of ``sequences`` (token ids), each group (``groups[i]``: sequence i's key; every sequence its
    own group when None) whole in one of them.

    ``max_tokens``: the fewest micro-batches of at most that many packed tokens (rounded up to a multiple of
    ``dp``); ``num_micro_batches``: exactly that many (a multiple of ``dp``), each within ``max_tokens`` when both
    are given. Of the cuts into that many contiguous runs, the plan takes the one with the fewest packed tokens in
    all; with ``dp`` > 1 or ``num_micro_batches``, among runs within 3% of the smallest largest run possible.
    ``loss_masks[i]`` (per token, nonzero = trainable) gives the trainable-token counts; by default every token but
    the first. Deterministic: the same input gives the same plan. Micro-batch i goes to rank ``i % dp``, step ``i // dp``.
    """
    _positive("max_tokens", max_tokens)
    _positive("num_micro_batches", num_micro_batches)
    _positive("dp", dp)
    if max_tokens is None and num_micro_batches is None:
        raise TreepackError("E_ARG", "give max_tokens, num_micro_batches or both", field="max_tokens")
    if num_micro_batches is not None and num_micro_batches % dp:
        raise TreepackError("E_ARG", f"num_micro_batches {num_micro_batches} is not a multiple of dp {dp}", field="num_micro_batches")
    S = len(sequences)
    keys = list(range(S)) if groups is None else list(groups)
    if len(keys) != S:
        raise TreepackError("E_ARG", f"{len(keys)} group keys for {S} sequences", field="groups")
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    if loss_masks is None:
        trainable = np.maximum(lengths - 1, 0)
    else:
        if len(loss_masks) != S or any(len(m) != n for m, n in zip(loss_masks, lengths)):
            raise TreepackError("E_ARG", "expected one loss mask per sequence, as long as it", field="loss_masks")
        trainable = np.array([int(np.count_nonzero(np.asarray(m))) for m in loss_masks], dtype=np.int64)

    forest = pack_sequences(sequences)
    offsets = np.asarray(forest.seq_offsets, dtype=np.int64)
    positions = np.asarray(forest.seq_positions, dtype=np.int64)
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)

    # A group's place in the forest: the preorder position of its first sequence's last token, so groups under one
    # subtree (a shared prompt) are adjacent; ties (a group of empty sequences) keep first-seen order.
    def place(i: int) -> int:
        return int(positions[offsets[i + 1] - 1]) if lengths[i] else -1

    order = sorted(members, key=lambda k: min(place(i) for i in members[k]))
    unit_nodes = [np.unique(np.concatenate([positions[offsets[i] : offsets[i + 1]] for i in members[k]])) for k in order]
    runs = _Runs(unit_nodes, len(forest.input_ids))
    biggest = max(range(len(order)), key=lambda u: len(unit_nodes[u]), default=None)
    if biggest is not None and max_tokens is not None and len(unit_nodes[biggest]) > max_tokens:
        raise TreepackError(
            "E_ARG",
            f"group {order[biggest]!r} alone packs to {len(unit_nodes[biggest])} tokens, over the budget of {max_tokens}; "
            "a group is never split, so raise max_tokens or make the group smaller",
            field="max_tokens",
        )
    count = num_micro_batches
    if count is None:
        # Without num_micro_batches, max_tokens is given (checked above).
        count = -(-len(runs.cuts(max_tokens)) // dp) * dp if order and max_tokens is not None else dp
    if len(order) < count:
        raise TreepackError("E_ARG", f"{count} micro-batches need at least {count} groups, got {len(order)}", field="num_micro_batches")
    limit = float("inf") if max_tokens is None else max_tokens
    if dp > 1 or num_micro_batches is not None:
        limit = min(limit, math.floor(_smallest_largest(runs, count) * (1 + COST_SLACK)))
    ends = _cheapest_cuts(runs, count, limit)
    if ends is None:
        raise TreepackError(
            "E_ARG", f"{count} micro-batches cannot keep every group whole within {max_tokens} packed tokens", field="max_tokens"
        )

    mbs = []
    for j, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        seqs = np.array(sorted(i for k in order[a:b] for i in members[k]), dtype=np.int64)
        mbs.append(
            MicroBatchPlan(
                seqs, order[a:b], runs.tokens(a, b), int(lengths[seqs].sum()), int(trainable[seqs].sum()), len(seqs), j % dp, j // dp
            )
        )
    return Plan(mbs, sum(m.packed_tokens for m in mbs), len(forest.input_ids), int(lengths.sum()), int(trainable.sum()), S)


def _smallest_largest(runs: _Runs, count: int) -> int:
    """The smallest largest run of at most ``count`` contiguous runs (the greedy split is monotone in its limit)."""
    lo, hi = max((len(n) for n in runs.nodes), default=0), sum(len(n) for n in runs.nodes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(runs.cuts(mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cheapest_cuts(runs: _Runs, count: int, limit: float) -> list[int] | None:
    """Ends of exactly ``count`` contiguous runs (count <= units), each within ``limit``, with the fewest packed tokens
    in all (cheapestCuts of src/pack/budget.ts: one layer per run, ties to the latest start); None if there are none."""
    windows = runs.windows(limit)
    U = len(windows)
    prev = np.full(U + 1, np.inf)
    prev[0] = 0.0
    choices = []
    for _ in range(count):
        cur, choice = np.full(U + 1, np.inf), np.full(U + 1, -1, dtype=np.int64)
        for j in range(1, U + 1):
            sizes = windows[j - 1]  # sizes[k]: run [j-1-k, j)
            cand = prev[j - 1 - np.arange(len(sizes))] + sizes
            k = int(np.argmin(cand))  # the smallest k among ties: the latest start
            cur[j], choice[j] = cand[k], j - 1 - k
        choices.append(choice)
        prev = cur
    if not np.isfinite(prev[U]):
        return None
    ends, j = [], U
    for choice in reversed(choices):
        ends.append(j)
        j = int(choice[j])
    return ends[::-1]
