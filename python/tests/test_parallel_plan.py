"""The shared-prefix and parallel-planner extensions (docs/design.md §11) as the Python side reads them: the manifest's
``shared_prefixes`` and ``parallel_plans``, an entry's ``prefix_shared`` and ``cp_ranks``, and the micro-batch header
keys of the same names; every malformed one an E_INPUT naming its field. Manifests and files are built here by hand.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import unittest
from typing import Any

import treepack
from test_microbatch import micro_batch_tensors, safetensors_bytes
from treepack.microbatch import TreepackError


def piece(**over: Any) -> dict[str, Any]:
    p = {"id": 0, "step": 0, "sequence": "s0", "start": 0, "end": 10, "ranks": [0, 1], "ranges": [[0, 5], [5, 10]]}
    p.update(over)
    return p


class ManifestTest(unittest.TestCase):
    def setUp(self) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self.dir = self._dir.name

    def tearDown(self) -> None:
        self._dir.cleanup()

    def entry(self, rank: int, **over: Any) -> dict[str, Any]:
        e = {"file": f"m{rank}", "sequences": 1, "naive_tokens": 12, "packed_tokens": 12, "rank": rank, "step": 0}
        e.update({"prefix_tokens": 10, "prefix_push": [10], "prefix_release": 1, "prefix_shared": [0]})
        e.update(over)
        return e

    def read(self, **doc: Any) -> dict[str, Any]:
        full = {"format": "treepack/1", "dp": 2, "micro_batches": [self.entry(0), self.entry(1)], "shared_prefixes": [piece()]}
        full.update(doc)
        with open(os.path.join(self.dir, "manifest.json"), "w") as f:
            json.dump(full, f)
        return treepack.read_manifest(self.dir)

    def refused(self, field: str, fragment: str, **doc: Any) -> None:
        with self.assertRaises(TreepackError) as cm:
            self.read(**doc)
        self.assertEqual((cm.exception.code, cm.exception.field), ("E_INPUT", field))
        self.assertIn(fragment, str(cm.exception))

    def test_reads_a_plan_with_shared_pieces_and_the_planner_choice(self) -> None:
        plans = [{"step": 0, "steps": 1, "mode": "shared", "cp": 1, "why": "shared: time 10", "candidates": []}]
        doc = self.read(parallel_plans=plans)
        self.assertEqual(doc["shared_prefixes"][0]["ranges"], [[0, 5], [5, 10]])
        self.assertEqual(doc["parallel_plans"][0]["mode"], "shared")
        # An entry of a context-parallel group names its ranks, the first being its rank.
        cp = self.entry(0, cp_ranks=[0, 1])
        del cp["prefix_shared"]
        self.read(micro_batches=[cp], shared_prefixes=[])

    def test_refuses_malformed_pieces(self) -> None:
        self.refused("shared_prefixes[0]", "id = 0", shared_prefixes=[piece(id=3)])
        self.refused("shared_prefixes[0].end", "non-empty", shared_prefixes=[piece(end=0)])
        self.refused("shared_prefixes[0].ranks", "consecutive", shared_prefixes=[piece(ranks=[0, 2])])
        self.refused("shared_prefixes[0].ranks", "dp = 2", shared_prefixes=[piece(ranks=[1, 2])])
        self.refused("shared_prefixes[0].ranges", "covering [0, 10)", shared_prefixes=[piece(ranges=[[0, 4], [5, 10]])])
        self.refused("shared_prefixes[0].ranges", "covering [0, 10)", shared_prefixes=[piece(ranges=[[0, 5], [5, 9]])])
        self.refused("shared_prefixes[0].sequence", "sequence id", shared_prefixes=[piece(sequence=3)])
        self.refused("parallel_plans", "mode", parallel_plans=[{"mode": "tp", "cp": 1}])

    def test_refuses_entries_that_disagree_with_their_pieces(self) -> None:
        bad = [self.entry(0, prefix_shared=[1]), self.entry(1)]
        self.refused("micro_batches[0].prefix_shared", "has 1 pieces", micro_batches=bad)
        bad = [self.entry(0, prefix_shared=[0, None]), self.entry(1)]
        self.refused("micro_batches[0].prefix_shared", "per prefix_push entry", micro_batches=bad)
        # Rank 2 is not in the piece's group; a segment ending elsewhere than the piece is not the piece.
        self.refused("micro_batches[1].prefix_shared", "on ranks [0, 1]", micro_batches=[self.entry(0), self.entry(2)], dp=4)
        bad = [self.entry(0, prefix_tokens=12, prefix_push=[12]), self.entry(1)]
        self.refused("micro_batches[0].prefix_shared", "ends at 12", micro_batches=bad)
        bad = [self.entry(1, cp_ranks=[0, 1]), self.entry(1)]
        self.refused("micro_batches[0].cp_ranks", "the first = rank", micro_batches=bad)


class HeaderTest(unittest.TestCase):
    def load(self, **keys: str) -> treepack.MicroBatch:
        rnd = random.Random(1)
        seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 7]]
        tensors, meta = micro_batch_tensors(seqs, rnd)
        meta.update({"prefix_tokens": "3", "prefix_push": "[2, 3]", "prefix_release": "1"}, **keys)
        return treepack.load(safetensors_bytes(tensors, meta))

    def test_reads_and_checks_prefix_shared_and_cp_ranks(self) -> None:
        mb = self.load(prefix_shared="[4, null]", cp_ranks="[2, 3]")
        self.assertEqual((mb.meta["prefix_shared"], mb.meta["cp_ranks"]), ([4, None], [2, 3]))
        for key, value, fragment in (
            ("prefix_shared", "[4]", "per prefix_push entry"),
            ("prefix_shared", "[-1, null]", "per prefix_push entry"),
            ("prefix_shared", "x", "per prefix_push entry"),
            ("cp_ranks", "[3]", "two or more"),
            ("cp_ranks", "[3, 2]", "ascending"),
        ):
            with self.assertRaises(TreepackError) as cm:
                self.load(**{key: value})
            self.assertEqual(cm.exception.field, key, value)
            self.assertIn(fragment, str(cm.exception))


if __name__ == "__main__":
    unittest.main()
