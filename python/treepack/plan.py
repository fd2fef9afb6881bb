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
they share. The rules are those of the TypeScript planner (planMicroBatches of src/pack/budget.ts, docs/design.md
§9), ported one for one with a group as the unit: the fewest micro-batches within the budget (rounded up to a
multiple of ``dp``); with ``dp`` > 1 or a fixed ``num_micro_batches``, each run's cost (a·tokens + b·attention
pairs, treepack.balance) held within 3% of the smallest largest cost that many runs allow; then, of all the cuts
into at most that many runs, the ones that repeat the fewest prefix tokens (a dynamic program over the cuts, ties to
the latest cut, then to more runs). The ranks are balanced by cost as src/pack/balance.ts balances them
(treepack.balance.assign_ranks): the same micro-batch on the same rank at the same step. With single-sequence
groups the plan is TypeScript's with ``refine: false``, element for element (test/python-plan.test.ts, dp = 1, 2,
3, 8); TypeScript's refinement moves single sequences between micro-batches, which whole groups rule out.

A group that alone exceeds ``max_tokens`` is refused (TreepackError naming the group): splitting it would change
per-group normalisers and lose its sharing, and giving it an over-budget micro-batch would break the memory bound
the budget stands for.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .balance import CostModel, assign_ranks
from .errors import TreepackError
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
    attention_pairs: int  # (query, key) pairs under the tree mask: Σ over its nodes of depth + 1
    cost: float  # a·packed_tokens + b·attention_pairs of the plan's CostModel


@dataclass
class Plan:
    """A window's plan: ``micro_batches`` step-major (step 0 of ranks 0..dp-1, then step 1, ...; each rank's steps
    by decreasing cost), their summed ``packed_tokens``, ``optimum_tokens`` (the window as one forest: the lower
    bound of any split), the step's naive and trainable tokens (what a global token-mean divides by) and sequences,
    and ``rank_costs``, each rank's summed cost."""

    micro_batches: list[MicroBatchPlan]  # step-major: step 0 of ranks 0..dp-1, then step 1, …
    packed_tokens: int  # Σ over micro-batches
    optimum_tokens: int  # the window as one forest: the lower bound of any split
    naive_tokens: int
    trainable_tokens: int  # the step's: what a global token-mean divides by
    num_sequences: int
    rank_costs: list[float]  # summed cost of each rank's micro-batches


# Slack on the smallest largest cost with dp > 1 or a fixed count: room to move cuts to shallow points (COST_SLACK of
# src/pack/budget.ts).
COST_SLACK = 0.03
# The cut program keeps one choice per (micro-batch, group); past this many it falls back to greedy cuts (MAX_DP_CELLS).
MAX_DP_CELLS = 1 << 24


def _positive(name: str, v: int | None) -> int | None:
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {v!r}", field=name)
    return v


class _Runs:
    """The groups in forest order with their nodes; packed tokens and attention pairs of contiguous runs, counted
    with one mark array. A run fits when it holds at most ``B`` packed tokens and costs at most ``U`` (Runs.fits)."""

    def __init__(self, unit_nodes: list[np.ndarray], weight: np.ndarray, cost: CostModel):
        self.nodes = unit_nodes
        self.weight = weight  # per node: depth + 1, the attention pairs it adds
        self.cost = cost
        self.mark = np.zeros(len(weight), dtype=bool)

    def _fresh(self, u: int) -> tuple[int, int]:
        """Tokens and pairs unit ``u`` adds to the marked nodes; marks them."""
        nodes = self.nodes[u]
        fresh = nodes[~self.mark[nodes]]
        self.mark[fresh] = True
        return len(fresh), int(self.weight[fresh].sum())

    def _clear(self, a: int, b: int) -> None:
        for u in range(a, b):
            self.mark[self.nodes[u]] = False

    def greedy(self, B: float, U: float) -> list[int]:
        """Run ends of the greedy split, each run as long as it fits (the fewest runs); every unit fits alone (the
        callers' limits are at least the largest unit)."""
        ends: list[int] = []
        start, tokens, pairs = 0, 0, 0
        for u in range(len(self.nodes)):
            t, p = self._fresh(u)
            if u > start and (tokens + t > B or self.cost.of(tokens + t, pairs + p) > U):
                self._clear(start, u + 1)
                ends.append(u)
                start, tokens, pairs = u, 0, 0
                t, p = self._fresh(u)
            tokens, pairs = tokens + t, pairs + p
        self._clear(start, len(self.nodes))
        return ends + [len(self.nodes)]

    def union(self, a: int, b: int) -> np.ndarray:
        return np.unique(np.concatenate(self.nodes[a:b])) if b > a else np.zeros(0, dtype=np.int64)

    def tokens(self, a: int, b: int) -> int:
        return len(self.union(a, b))

    def pairs(self, a: int, b: int) -> int:
        return int(self.weight[self.union(a, b)].sum())

    def cost_of(self, a: int, b: int) -> float:
        nodes = self.union(a, b)
        return self.cost.of(len(nodes), int(self.weight[nodes].sum()))

    def windows(self, B: float, U: float) -> list[np.ndarray]:
        """For each run end j (1..units), the packed tokens of runs [i, j) for i = j-1, j-2, ... while they fit (at
        least the unit alone): entry k is run [j-1-k, j)."""
        out = []
        for j in range(1, len(self.nodes) + 1):
            sizes: list[int] = []
            tokens = pairs = 0
            i = j - 1
            while i >= 0:
                t, p = self._fresh(i)
                if sizes and (tokens + t > B or self.cost.of(tokens + t, pairs + p) > U):
                    self.mark[self.nodes[i]] = False
                    self._clear(i + 1, j)
                    break
                tokens, pairs = tokens + t, pairs + p
                sizes.append(tokens)
                i -= 1
            else:
                self._clear(0, j)
            out.append(np.array(sizes, dtype=np.float64))
        return out


def plan_micro_batches(
    sequences: Sequence[Sequence[int]],
    max_tokens: int | None = None,
    groups: Sequence[Hashable] | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
    num_micro_batches: int | None = None,
    dp: int = 1,
    cost: CostModel | None = None,
) -> Plan:
    """Micro-batches of ``sequences`` (token ids), each group (``groups[i]``: sequence i's key; every sequence its
    own group when None) whole in one of them.

    ``max_tokens``: the fewest micro-batches of at most that many packed tokens, rounded up to a multiple of ``dp``
    (with ``dp`` > 1 some may be empty, as in TypeScript); ``num_micro_batches``: exactly that many (a multiple of
    ``dp``), each within ``max_tokens`` when both are given. Of the cuts into contiguous runs, the plan takes the one
    with the fewest packed tokens in all; with ``dp`` > 1 or ``num_micro_batches``, among runs that cost at most 3%
    over the smallest largest cost possible. ``cost`` (a·tokens + b·attention pairs, treepack.balance.CostModel)
    balances the ranks. ``loss_masks[i]`` (per token, nonzero = trainable) gives the trainable-token counts; by
    default every token but the first. Deterministic: the same input gives the same plan.
    """
    _positive("max_tokens", max_tokens)
    _positive("num_micro_batches", num_micro_batches)
    _positive("dp", dp)
    model = (CostModel() if cost is None else cost).check()
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
    runs = _Runs(unit_nodes, np.asarray(forest.position_ids, dtype=np.int64) + 1, model)
    biggest = max(range(len(order)), key=lambda u: len(unit_nodes[u]), default=None)
    if biggest is not None and max_tokens is not None and len(unit_nodes[biggest]) > max_tokens:
        raise TreepackError(
            "E_ARG",
            f"group {order[biggest]!r} alone packs to {len(unit_nodes[biggest])} tokens, over the budget of {max_tokens}; "
            "a group is never split, so raise max_tokens or make the group smaller",
            field="max_tokens",
        )
    B = math.inf if max_tokens is None else float(max_tokens)
    if num_micro_batches is not None:
        count = num_micro_batches
        if len(order) < count:
            raise TreepackError("E_ARG", f"{count} micro-batches need at least {count} groups, got {len(order)}", field="num_micro_batches")
        ends = _cheapest_cuts(runs, count, B, _cost_limit(runs, count, B), exact=True)
        if ends is None:
            raise TreepackError(
                "E_ARG", f"{count} micro-batches cannot keep every group whole within {max_tokens} packed tokens", field="max_tokens"
            )
    elif order:
        count = -(-len(runs.greedy(B, math.inf)) // dp) * dp
        ends = _cheapest_cuts(runs, count, B, _cost_limit(runs, count, B) if dp > 1 else math.inf, exact=False)
        assert ends is not None  # the greedy split is the fallback
    else:
        count, ends = 0, []

    # Runs past the last end stay empty: every rank still runs the same number of steps.
    spans = [(a, b) for a, b in zip([0] + ends[:-1], ends)]
    spans += [(len(order), len(order))] * (count - len(spans))
    nodes = [runs.union(a, b) for a, b in spans]
    costs = [model.of(len(n), int(runs.weight[n].sum())) for n in nodes]
    rank, step = assign_ranks(costs, dp)
    rank_costs = [0.0] * dp
    mbs: list[MicroBatchPlan | None] = [None] * count
    for j, (a, b) in enumerate(spans):
        seqs = np.array(sorted(i for k in order[a:b] for i in members[k]), dtype=np.int64)
        rank_costs[rank[j]] += costs[j]
        mbs[step[j] * dp + rank[j]] = MicroBatchPlan(
            seqs,
            order[a:b],
            len(nodes[j]),
            int(lengths[seqs].sum()),
            int(trainable[seqs].sum()),
            len(seqs),
            rank[j],
            step[j],
            int(runs.weight[nodes[j]].sum()),
            costs[j],
        )
    planned = [m for m in mbs if m is not None]
    return Plan(
        planned, sum(m.packed_tokens for m in planned), len(forest.input_ids), int(lengths.sum()), int(trainable.sum()), S, rank_costs
    )


def _cost_limit(runs: _Runs, count: int, B: float) -> float:
    """The smallest largest run cost of at most ``count`` runs within ``B`` tokens (feasibility is monotone in the
    limit: a bisection, as budget.ts runs it), plus COST_SLACK."""
    units = len(runs.nodes)
    hi, lo = runs.cost_of(0, units), 0.0
    for u in range(units):
        lo = max(lo, runs.cost_of(u, u + 1))
    if len(runs.greedy(B, lo)) > count:
        for _ in range(60):
            if not hi - lo > 1e-9 * hi:
                break
            mid = (lo + hi) / 2
            if len(runs.greedy(B, mid)) <= count:
                hi = mid
            else:
                lo = mid
    else:
        hi = lo
    return hi * (1 + COST_SLACK)


def _cheapest_cuts(runs: _Runs, count: int, B: float, U: float, exact: bool) -> list[int] | None:
    """Ends of at most ``count`` contiguous runs (exactly ``count`` when ``exact``), each fitting, with the fewest
    packed tokens in all (cheapestCuts of src/pack/budget.ts: one layer per run, ties to the latest start, then to
    more runs). Without ``exact``, the greedy split where the program would be too large or finds no plan; with it,
    None where there is none."""
    units = len(runs.nodes)
    if not exact and count * (units + 1) > MAX_DP_CELLS:
        return runs.greedy(B, U)
    windows = runs.windows(B, U)
    prev = np.full(units + 1, np.inf)
    prev[0] = 0.0
    choices = []
    best, best_c = np.inf, -1
    for c in range(1, count + 1):
        cur, choice = np.full(units + 1, np.inf), np.full(units + 1, -1, dtype=np.int64)
        for j in range(1, units + 1):
            sizes = windows[j - 1]  # sizes[k]: run [j-1-k, j)
            cand = prev[j - 1 - np.arange(len(sizes))] + sizes
            k = int(np.argmin(cand))  # the smallest k among ties: the latest start
            cur[j], choice[j] = cand[k], j - 1 - k
        choices.append(choice)
        prev = cur
        # Among equally cheap plans the one with more runs spreads the work more evenly.
        if np.isfinite(prev[units]) and (c == count or not exact) and prev[units] <= best:
            best, best_c = prev[units], c
    if best_c < 0:
        return None if exact else runs.greedy(B, U)
    ends, j = [], units
    for choice in reversed(choices[:best_c]):
        ends.append(j)
        j = int(choice[j])
    return ends[::-1]
