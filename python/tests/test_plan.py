"""plan_micro_batches against brute force: packed tokens are the distinct prefixes of a micro-batch's sequences,
groups stay whole, the counts are the trainer's normalisers, the budget holds with the fewest micro-batches, and of
those splits the plan repeats the fewest prefix tokens (the cut program of src/pack/budget.ts); a fixed count keeps
the largest micro-batch within 3% of the smallest any contiguous split has, again with the fewest packed tokens; a
group over the budget is refused by name. Skipped, with its reason, where the C core is not built."""

from __future__ import annotations

import itertools
import random
import unittest

import treepack
from treepack import TreepackError, plan_micro_batches
from treepack.balance import CostModel

DEFAULT = CostModel()

try:
    treepack.pack_sequences([[1]])
    SKIP = ""
except TreepackError as e:  # E_BACKEND
    SKIP = str(e)


def prefixes(seqs):
    return {tuple(s[: t + 1]) for s in seqs for t in range(len(s))}


def distinct_prefixes(seqs):
    return len(prefixes(seqs))


def pairs(seqs):
    """Attention pairs under the tree mask: a node at depth d sees its d + 1 ancestors-or-self."""
    return sum(len(p) for p in prefixes(seqs))


def window(seed: int, groups: int = 6, g: int = 3):
    """Groups of g sequences sharing a prompt; prompts share a system stem across groups."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(2, 50) for _ in range(n)]  # noqa: E731
    system = tok(3)
    seqs, keys, masks = [], [], []
    for k in range(groups):
        prompt = system + tok(r.randrange(1, 4)) if r.random() < 0.7 else tok(4)
        for _ in range(g):
            resp = tok(r.randrange(1, 6))
            seqs.append(prompt + resp)
            keys.append(f"g{k}")
            masks.append([0] * len(prompt) + [r.randrange(2) or 1 for _ in resp])
    order = list(range(len(seqs)))
    r.shuffle(order)  # the planner must not rely on input order
    return [seqs[i] for i in order], [keys[i] for i in order], [masks[i] for i in order]


@unittest.skipIf(bool(SKIP), SKIP)
class PlanTest(unittest.TestCase):
    def check(self, plan, seqs, keys, masks, cost=DEFAULT):
        seen = []
        for mb in plan.micro_batches:
            mine = [seqs[i] for i in mb.sequences]
            self.assertEqual(mb.packed_tokens, distinct_prefixes(mine))
            self.assertEqual(mb.attention_pairs, pairs(mine))
            self.assertEqual(mb.cost, cost.a * mb.packed_tokens + cost.b * mb.attention_pairs)
            self.assertEqual(mb.naive_tokens, sum(map(len, mine)))
            self.assertEqual(mb.trainable_tokens, sum(sum(masks[i]) for i in mb.sequences))
            self.assertEqual(mb.num_sequences, len(mine))
            self.assertEqual(sorted(mb.groups), sorted({keys[i] for i in mb.sequences}))
            seen.extend(mb.sequences.tolist())
        self.assertEqual(sorted(seen), list(range(len(seqs))))  # every sequence once
        owner = {}
        for j, mb in enumerate(plan.micro_batches):
            for i in mb.sequences:
                self.assertEqual(owner.setdefault(keys[i], j), j, f"group {keys[i]} split")
        self.assertEqual(plan.trainable_tokens, sum(map(sum, masks)))
        self.assertEqual(plan.num_sequences, len(seqs))
        self.assertEqual(plan.optimum_tokens, distinct_prefixes(seqs))
        self.assertEqual(plan.packed_tokens, sum(m.packed_tokens for m in plan.micro_batches))

    def group_order(self, plan, seqs):
        """The groups in cut order: micro-batches are listed by step and rank, and their runs follow the forest's
        order, the lexicographic order of their sequences."""
        runs = sorted((mb for mb in plan.micro_batches if mb.num_sequences), key=lambda m: min(tuple(seqs[i]) for i in m.sequences))
        return [k for mb in runs for k in mb.groups]

    def test_budget(self):
        for seed in range(5):
            seqs, keys, masks = window(seed)
            for budget in (25, 40, 80, 1000):
                with self.subTest(seed=seed, budget=budget):
                    try:
                        plan = plan_micro_batches(seqs, max_tokens=budget, groups=keys, loss_masks=masks)
                    except TreepackError as e:
                        biggest = max(distinct_prefixes([s for s, k in zip(seqs, keys) if k == g]) for g in set(keys))
                        self.assertGreater(biggest, budget)
                        self.assertEqual(e.field, "max_tokens")
                        self.assertIn("alone packs to", str(e))
                        continue
                    self.check(plan, seqs, keys, masks)
                    self.assertTrue(all(m.packed_tokens <= budget for m in plan.micro_batches))
                    # The fewest micro-batches of contiguous runs of the plan's group order (brute force).
                    order = self.group_order(plan, seqs)
                    self.assertEqual(len(plan.micro_batches), self.fewest(order, seqs, keys, budget))
                    self.assertEqual(plan.packed_tokens, self.cheapest(order, seqs, keys, len(plan.micro_batches), budget))
                    again = plan_micro_batches(seqs, max_tokens=budget, groups=keys, loss_masks=masks)
                    self.assertEqual(
                        [(m.sequences.tolist(), m.groups) for m in again.micro_batches],
                        [(m.sequences.tolist(), m.groups) for m in plan.micro_batches],
                    )

    def runs(self, order, seqs, keys, ends, cost=None):
        """Packed tokens of each run (its cost under ``cost`` when given)."""
        starts = [0] + ends[:-1]
        mine = [[s for s, k in zip(seqs, keys) if k in order[a:b]] for a, b in zip(starts, ends)]
        return [distinct_prefixes(m) if cost is None else cost.of(distinct_prefixes(m), pairs(m)) for m in mine]

    def fewest(self, order, seqs, keys, budget):
        U = len(order)
        for n in range(1, U + 1):
            for cuts in itertools.combinations(range(1, U), n - 1):
                if max(self.runs(order, seqs, keys, list(cuts) + [U])) <= budget:
                    return n
        return None

    def cheapest(self, order, seqs, keys, n, limit, cost=None):
        """The fewest packed tokens of a split of ``order`` into exactly n contiguous runs, each within limit (of
        packed tokens, or of cost under ``cost``)."""
        U = len(order)
        splits = [list(c) + [U] for c in itertools.combinations(range(1, U), n - 1)]
        return min(sum(self.runs(order, seqs, keys, e)) for e in splits if max(self.runs(order, seqs, keys, e, cost)) <= limit)

    def test_count(self):
        # The default cost is nearly the packed tokens; b = 0.05 makes attention pairs weigh.
        for seed, count, cost in itertools.product(range(4), (1, 2, 3, 6), (DEFAULT, CostModel(1.0, 0.05))):
            seqs, keys, masks = window(seed)
            with self.subTest(seed=seed, count=count, cost=cost):
                plan = plan_micro_batches(seqs, groups=keys, loss_masks=masks, num_micro_batches=count, cost=cost)
                self.check(plan, seqs, keys, masks, cost)
                self.assertEqual(len(plan.micro_batches), count)
                order = self.group_order(plan, seqs)
                best = min(
                    max(self.runs(order, seqs, keys, list(c) + [len(order)], cost))
                    for c in itertools.combinations(range(1, len(order)), count - 1)
                )
                # The planner's limit is best·1.03 up to its bisection's 1e-9 (relative): the plan's packed tokens
                # lie between the cheapest splits under the two ends of that interval.
                low, high = best * 1.03, best * (1 + 1e-9) * 1.03
                self.assertLessEqual(max(m.cost for m in plan.micro_batches), high)
                self.assertGreaterEqual(plan.packed_tokens, self.cheapest(order, seqs, keys, count, high, cost))
                self.assertLessEqual(plan.packed_tokens, self.cheapest(order, seqs, keys, count, low, cost))
        with self.assertRaises(TreepackError) as e:
            plan_micro_batches(seqs, groups=keys, num_micro_batches=7)
        self.assertEqual(e.exception.field, "num_micro_batches")

    def test_dp_and_defaults(self):
        seqs, keys, masks = window(1)
        plan = plan_micro_batches(seqs, max_tokens=40, groups=keys, loss_masks=masks, dp=2)
        self.check(plan, seqs, keys, masks)
        self.assertEqual(len(plan.micro_batches) % 2, 0)
        # Step-major, each rank's steps by decreasing cost, the ranks balanced as assign_ranks balances them.
        self.assertEqual([(m.rank, m.step) for m in plan.micro_batches], [(j % 2, j // 2) for j in range(len(plan.micro_batches))])
        for r in (0, 1):
            costs = [m.cost for m in plan.micro_batches if m.rank == r]
            self.assertEqual(costs, sorted(costs, reverse=True))
        self.assertEqual(plan.rank_costs, [sum(m.cost for m in plan.micro_batches if m.rank == r) for r in (0, 1)])
        # Fewer groups than the micro-batches dp rounds up to: the rest are empty, as in TypeScript.
        plan = plan_micro_batches(seqs[:2], max_tokens=1000, dp=8)
        self.assertEqual([m.num_sequences for m in plan.micro_batches].count(0), 6)
        self.assertEqual(sorted(m.rank for m in plan.micro_batches), list(range(8)))
        # Without groups every sequence is its own; without loss masks every token but the first is trainable.
        plan = plan_micro_batches(seqs, max_tokens=30)
        self.assertEqual(plan.trainable_tokens, sum(len(s) - 1 for s in seqs))
        self.assertTrue(all(m.packed_tokens <= 30 for m in plan.micro_batches))
        for bad, field in (
            ({"max_tokens": 0}, "max_tokens"),
            ({}, "max_tokens"),
            ({"num_micro_batches": 3, "dp": 2}, "num_micro_batches"),
            ({"max_tokens": 40, "groups": keys[:-1]}, "groups"),
        ):
            with self.assertRaises(TreepackError) as e:
                plan_micro_batches(seqs, **bad)
            self.assertEqual(e.exception.field, field)


if __name__ == "__main__":
    unittest.main()
