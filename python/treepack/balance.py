"""The cost of a packed micro-batch and which data-parallel rank runs it: src/pack/balance.ts, rule for rule, so the
Python planner (plan.py) and the TypeScript one put the same micro-batch on the same rank at the same step
(test/python-plan.test.ts holds them equal, element for element, for dp in 1, 2, 3 and 8).

    >>> assign_ranks([5.0, 1.0, 4.0, 2.0], 2)   # (rank, step) of each micro-batch: loads 5+1 and 4+2
    ([0, 0, 1, 1], [0, 1, 0, 1])

Cost = a·(packed tokens) + b·(attention pairs), a pair being one (query, key) the tree mask lets through: Σ over
the micro-batch's nodes of depth + 1 (docs/design.md §9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import TreepackError


@dataclass(frozen=True)
class CostModel:
    """Cost coefficients in units of one token's dense work: ``a`` per packed token, ``b`` per attention pair.

    The default is DEFAULT_COST of src/pack/balance.ts: a dense decoder does about 6·P FLOPs per token for P
    parameters and 12·L·d per attention pair, so b/a = 2·L·d/P, 2.6e-5 for a 7B model (L = 28, d = 3584)."""

    a: float = 1.0
    b: float = 2.6e-5

    def check(self) -> CostModel:
        """Itself, after checking each coefficient is a finite number >= 0 (TreepackError naming it otherwise)."""
        for name, v in (("a", self.a), ("b", self.b)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise TreepackError("E_ARG", f"expected a finite number >= 0, got {v!r}", field=f"cost.{name}")
        return self

    def of(self, tokens: int, pairs: int) -> float:
        """The cost of a micro-batch of ``tokens`` packed tokens and ``pairs`` attention pairs (microBatchCost)."""
        return self.a * float(tokens) + self.b * float(pairs)


def assign_ranks(costs: Sequence[float], dp: int) -> tuple[list[int], list[int]]:
    """Rank and step of each of n micro-batches (n a multiple of ``dp``), n/dp per rank, minimising the slowest rank
    (assignRanks): longest processing time first among ranks with a free slot, then the best swap between the
    slowest rank and another while one lowers the larger of the two loads (at most 4·n swaps). Steps go by
    decreasing cost within a rank, ties by index (stepsByCost)."""
    n = len(costs)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {dp!r}", field="dp")
    if n % dp:
        raise TreepackError("E_ARG", f"{n} micro-batches are not a multiple of dp {dp}", field="dp")
    per = n // dp
    c = np.asarray(costs, dtype=np.float64)
    rank = np.zeros(n, dtype=np.int64)
    loads = np.zeros(dp, dtype=np.float64)
    count = np.zeros(dp, dtype=np.int64)
    for i in _by_cost(c):
        free = np.flatnonzero(count < per)
        best = int(free[np.argmin(loads[free])])  # the first of the least loaded: TypeScript's strict '<'
        rank[i] = best
        loads[best] += c[i]
        count[best] += 1
    d = c[:, None] - c[None, :]  # d[i, j]: the load moving from i's rank to j's by swapping them
    for _ in range(4 * n):
        hi = int(np.argmax(loads))
        other = loads[rank]  # the load of j's rank, per j
        new_max = np.maximum(loads[hi] - d, other[None, :] + d)
        gain = np.where((rank[:, None] == hi) & (rank[None, :] != hi) & (d > 0), loads[hi] - new_max, 0.0)
        # The first (i, j) in row-major order with the largest positive gain: TypeScript's scan with a strict '>'.
        k = int(np.argmax(gain))
        if not gain.flat[k] > 0:
            break
        bi, bj = divmod(k, n)
        r = int(rank[bj])
        loads[hi] -= d[bi, bj]
        loads[r] += d[bi, bj]
        rank[bi], rank[bj] = r, hi
    ranks = rank.tolist()
    return ranks, steps_by_cost(c, ranks, dp)


def steps_by_cost(costs: Sequence[float] | np.ndarray, rank: Sequence[int], dp: int) -> list[int]:
    """Step of each micro-batch on its rank: by decreasing cost, ties by index (stepsByCost)."""
    step = [0] * len(rank)
    nxt = [0] * dp
    for i in _by_cost(np.asarray(costs, dtype=np.float64)):
        step[i] = nxt[rank[i]]
        nxt[rank[i]] += 1
    return step


def _by_cost(c: np.ndarray) -> list[int]:
    """Indices by decreasing cost, ties by index."""
    return [int(i) for i in np.lexsort((np.arange(len(c)), -c))]
