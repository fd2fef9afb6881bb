"""The cost side of trees across ranks: what the exchanges move, with the results unchanged (gloo, CPU, float64).

Sliding-window layers under context parallelism fetch only the keys their window reaches.

Three spawned ranks split test_cp_attention.py's forest (its bounds inside segments, at branch points, one
segment over the three ranks) and run a tiny gpt-oss (a sliding layer of window 4 with sinks, a full layer, MoE):
its sliding layer fetches only the context keys within 4 positions of some local query (``LocalPart.window_route``),
the full layer the whole context. Per-token logprobs, the loss and every parameter gradient equal the one-rank run
within 1e-10, and the bytes each rank receives are fewer than with the whole context fetched for every layer (the
same run with ``window_route`` answering None, which must give the same results: the keys left out are never seen).
Negative control: a window route that leaves out a key the window does reach (the nearest one) changes the logprobs.

Shared pieces (shared_prefix.py): the final hidden rows a rank's micro-batches read (``hidden_reads``: the parents in a
piece of their computed nodes, wherever on the piece they hang, and its last row under a segment above); the runs
against the unsplit forest are test/shared-prefix-run.test.ts's (shared_dir.py).
"""

from __future__ import annotations

import datetime
import json
import os
import unittest

from support import needs_torch, torch, tpt
from test_cp_attention import CONFIGS, TOL, build, cases, forest, run_case, spawn


def worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from treepack.torch.context_parallel import LocalPart, _route, window_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = build("gpt_oss")
    batch = tpt.load_microbatch(forest())
    batch.loss_mask[batch.seq_positions < 10] = False
    plan = cases(batch)
    real, split = LocalPart.window_route, tpt.split_batch
    stats: list[dict[str, int]] = []

    def keep_stats(b, cp, check=True):
        local = split(b, cp, check)
        stats.append(local.context_parallel.stats)
        return local

    results = {}
    for name in ("inside_segments", "at_branch_points", "segment_over_three"):
        for fetch in ("window", "whole"):
            if fetch == "whole":
                LocalPart.window_route = lambda self, window: None
            tpt.split_batch = keep_stats
            try:
                got = run_case(model, batch, plan[name], "block", CONFIGS["token-mean"], None)
            finally:
                tpt.split_batch, LocalPart.window_route = split, real
            got["received_bytes"] = stats.pop().get("received_bytes", 0)
            results[f"{name}/{fetch}"] = got

    # Negative control: the sliding layer's route without the nearest context key of this rank's window.
    def short(self, window):
        se, pos, b = self.subtree_end.cpu(), self.position_ids.cpu(), self.cp.bounds
        needs = [window_context(se, pos, b[r], b[r + 1], window)[:-1] for r in range(self.cp.size)]
        rows = torch.searchsorted(self.context.cpu(), needs[self.cp.rank])
        return _route(needs, b, self.cp.rank, self.context.device), rows

    LocalPart.window_route = short
    try:
        results["control"] = run_case(model, batch, plan["segment_over_three"], "block", CONFIGS["token-mean"], None)
    finally:
        LocalPart.window_route = real
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@needs_torch(transformers=True)
class WindowFetchOverGloo(unittest.TestCase):
    def test_window_layers_fetch_only_their_window_with_the_same_results(self):
        ranks = spawn(worker, 3)
        for name in ("inside_segments", "at_branch_points", "segment_over_three"):
            for r, res in enumerate(ranks):
                for fetch in ("window", "whole"):
                    got = res[f"{name}/{fetch}"]
                    with self.subTest(case=name, fetch=fetch, rank=r):
                        self.assertLessEqual(got["lp"], TOL)
                        self.assertLessEqual(got["loss"], TOL)
                        self.assertLessEqual(got["grad"], TOL * max(1.0, got["grad_scale"]))
                        self.assertGreater(got["grad_scale"], 1e-3)
                window, whole = res[f"{name}/window"]["received_bytes"], res[f"{name}/whole"]["received_bytes"]
                with self.subTest(case=name, rank=r, bytes=(window, whole)):
                    self.assertLessEqual(window, whole)
            # Rank 2's context (ancestors held by ranks 0 and 1) is longer than the window: it receives less.
            window, whole = ranks[2][f"{name}/window"]["received_bytes"], ranks[2][f"{name}/whole"]["received_bytes"]
            with self.subTest(case=name, bytes=(window, whole)):
                self.assertGreater(ranks[2][f"{name}/window"]["context"], 4)
                self.assertLess(window, whole)
        self.assertGreater(max(res["control"]["lp"] for res in ranks), 1e-6, "a key the window reaches, left out, must change the logprobs")


@needs_torch()
class HiddenReads(unittest.TestCase):
    def test_the_rows_a_micro_batch_reads_of_a_piece(self):
        from treepack.torch.shared_prefix import Piece, hidden_reads

        piece = Piece(0, 4, 10, (0, 1), ((4, 7), (7, 10)))
        # a chain [0, 12) cached (h = 12), then nodes hanging from depths 5 and 11, and one from 12 (its own)
        parent = torch.tensor(list(range(-1, 11)) + [5, 12, 11, 13])
        batch = type("B", (), {"parent": parent})()
        reads = torch.zeros(6, dtype=torch.bool)
        hidden_reads(piece, batch, 12, reads)
        self.assertEqual(torch.nonzero(reads).flatten().tolist(), [1, 5])  # depth 5 (a branch inside), depth 9 (under a segment)
        reads = torch.zeros(6, dtype=torch.bool)
        hidden_reads(piece, type("B", (), {"parent": torch.tensor(list(range(-1, 9)) + [9, 6, 10])})(), 10, reads)
        self.assertEqual(torch.nonzero(reads).flatten().tolist(), [2, 5])  # the piece on top: its branch points only


if __name__ == "__main__":
    unittest.main()
