"""pack_sequences with the per-token fields trainers have: each value lands at its (sequence, t) occurrence, checked
against the sequences as given (no packing logic here), and every bad input is refused naming the field and the
sequence."""

from __future__ import annotations

import random
import unittest

import numpy as np
import treepack
from treepack import TreepackError


def occurrences(seqs):
    """(sequence, t) of every occurrence k, in order: the contract's occurrence layout, written out."""
    return [(i, t) for i, s in enumerate(seqs) for t in range(len(s))]


class PerTokenFields(unittest.TestCase):
    def test_values_land_at_their_occurrence(self) -> None:
        rnd = random.Random(7)
        for trial in range(30):
            seqs = [[rnd.randrange(4) for _ in range(rnd.randint(0, 6))] for _ in range(rnd.randint(1, 6))]
            masks = [[0 if t == 0 else rnd.randint(0, 1) for t in range(len(s))] for s in seqs]
            adv = [rnd.choice([rnd.uniform(-2, 2), [rnd.uniform(-2, 2) for _ in s]]) for s in seqs]
            lps = {f: [[-rnd.random() for _ in s] for s in seqs] for f in ("old_logprobs", "ref_logprobs", "rollout_logprobs")}
            mb = treepack.pack_sequences(seqs, loss_mask=masks, advantages=adv, **lps)
            self.assertEqual(treepack.check_invariants(mb), [])
            self.assertEqual(treepack.check_values(mb), [])
            for k, (i, t) in enumerate(occurrences(seqs)):
                self.assertEqual(mb.input_ids[mb.seq_positions[k]], seqs[i][t], (trial, k))
                self.assertEqual(mb.loss_mask[k], masks[i][t])
                a = adv[i] if np.ndim(adv[i]) == 0 else adv[i][t]
                self.assertEqual(mb.advantages[k], np.float32(a if masks[i][t] else 0.0), (trial, i, t))
                for f, v in lps.items():
                    self.assertEqual(getattr(mb, f)[k], np.float32(v[i][t]))

    def test_defaults(self) -> None:
        mb = treepack.pack_sequences([[1, 2, 3], [], [1, 2]])
        self.assertEqual(mb.loss_mask.tolist(), [0, 1, 1, 0, 1])
        self.assertIsNone(mb.advantages)
        self.assertIsNone(mb.old_logprobs)
        mb = treepack.pack_sequences([[1, 2]], advantages=[np.float64(0.5)], loss_mask=[np.array([False, True])])
        self.assertEqual(mb.advantages.tolist(), [0.0, 0.5])

    def test_refusals_name_the_field_and_sequence(self) -> None:
        seqs = [[1, 2, 3], [1, 2, 4]]
        cases = [
            ({"loss_mask": [[0, 1, 1], [1, 1, 1]]}, "loss_mask", "sequence 1"),
            ({"loss_mask": [[0, 1, 2], [0, 1, 1]]}, "loss_mask", "expected 0 or 1"),
            ({"loss_mask": [[0, 1, 1]]}, "loss_mask", "1 entries for 2 sequences"),
            ({"old_logprobs": [[0, -1, -1], [0, -1]]}, "old_logprobs", "sequence 1 has 3 tokens"),
            ({"old_logprobs": [[0, -1, -1], [0, float("nan"), -1]]}, "old_logprobs", "(sequence 1) is nan"),
            ({"advantages": [1.0, [1.0, 2.0]]}, "advantages", "sequence 1 has 3 tokens"),
            ({"ref_logprobs": [0.5, 0.5]}, "ref_logprobs", "sequence 0"),
            ({"rollout_logprobs": [["a", "b", "c"], [0, 0, 0]]}, "rollout_logprobs", "sequence 0"),
        ]
        for kwargs, field, fragment in cases:
            with self.assertRaises(TreepackError, msg=str(kwargs)) as cm:
                treepack.pack_sequences(seqs, **kwargs)
            self.assertEqual((cm.exception.code, cm.exception.field), ("E_ARG", field), str(kwargs))
            self.assertIn(fragment, str(cm.exception))
        # Untrained tokens may hold anything: their values never enter the loss.
        mb = treepack.pack_sequences(seqs, loss_mask=[[0, 1, 1], [0, 0, 1]], old_logprobs=[[0, -1, -1], [float("nan"), float("nan"), -1]])
        self.assertTrue(np.isnan(mb.old_logprobs[4]))


if __name__ == "__main__":
    unittest.main()
