"""Flex attention under context parallelism, over two spawned gloo ranks on CPU: ``packed_logprobs(...,
attention="flex")`` on each rank's local part (compiled flex: on CPU forward only, float32) equals the one-rank flex
run at the rank's nodes, as the block path does; with the keys/values zeroed instead of exchanged it differs; a
forward that records a gradient is refused by name (FlexAttention has no backward on CPU). ``whole_row`` refuses a
batch that is no local part, and values of another length. The flex backward under
context parallelism runs on CUDA only and is not tested here.

The ranks are spawned, not forked: a fork after torch's OpenMP pool has run leaves the children waiting on it."""

from __future__ import annotations

import datetime
import os
import tempfile
import unittest
from unittest import mock

from support import needs_torch, pack, tiny_model, torch, tpt

VOCAB = 64


def forest():
    """Two prompts of 9 tokens with three and two answers, sharing stems inside each group."""
    P, Q = [3, 5, 7, 11, 13, 17, 19, 23, 29], [31, 37, 41, 43, 47, 53, 59, 2, 4]
    return pack([P + [6, 8, 10, 12], P + [6, 8, 14], P + [16, 18, 20, 22, 24], Q + [9, 9, 9], Q + [9, 30, 32, 34]], seed=3)


def flex_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from treepack import TreepackError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    model = tiny_model("qwen3", torch.float32, vocab=VOCAB)
    batch = tpt.load_microbatch(forest())
    cp = tpt.ContextParallel.of(batch)
    local = tpt.split_batch(batch, cp)
    A = local.context_parallel.rows
    report: dict = {"bounds": cp.bounds, "context": A}
    with torch.no_grad():
        for mode in ("flex", "block"):
            whole = tpt.packed_logprobs(model, batch, attention=mode, nodes="all").logprobs[cp.lo : cp.hi]
            part = tpt.packed_logprobs(model, local, attention=mode, nodes="all").logprobs[A:]
            report[mode] = (whole, part)
        from treepack.torch.context_parallel import LocalPart

        zero = lambda self, x, route, what: x.new_zeros((route.owner.numel(),) + tuple(x.shape[1:]))  # noqa: E731
        with mock.patch.object(LocalPart, "fetch", zero):
            report["zero_exchange"] = tpt.packed_logprobs(model, local, attention="flex", nodes="all").logprobs[A:]
    for name, run in (
        ("grad", lambda: tpt.packed_logprobs(model, local, attention="flex")),
        ("whole_row_length", lambda: tpt.whole_row(torch.zeros(batch.num_nodes), local)),  # the row's N, not the part's
        ("whole_row_plain", lambda: tpt.whole_row(torch.zeros(batch.num_nodes), batch)),
    ):
        try:
            run()
            report[name] = "ran"
        except TreepackError as e:
            report[name] = f"{e.code} {e.field}: {e}"
    torch.save(report, os.path.join(out, f"flex{rank}.pt"))
    dist.destroy_process_group()


@needs_torch(transformers=True)
class CPFlexTest(unittest.TestCase):
    def test_flex_local_part(self):
        """Compiled flex on each rank's local part equals the one-rank flex run at its nodes. float32: both run the
        same kernel on the same keys, padded and ordered differently, so they differ by float32 rounding of the
        softmax sums; held to 1e-5, as python/tests/gpu/test_flex_compiled.py holds a model's flex logprobs against
        the unpacked run's. The block path is held the same way. Zeroed instead of exchanged, the keys/values move
        them by far more. A forward that records a gradient is refused on CPU, and whole_row's bad inputs."""
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            mp.spawn(flex_worker, args=(2, out), nprocs=2, join=True)
            reports = [torch.load(os.path.join(out, f"flex{r}.pt")) for r in range(2)]
        self.assertGreater(reports[1]["context"], 0)  # rank 1 reads keys/values from rank 0
        for rank, rep in enumerate(reports):
            with self.subTest(rank=rank):
                for mode in ("flex", "block"):
                    whole, part = rep[mode]
                    self.assertTrue(torch.equal(whole.isnan(), part.isnan()), mode)
                    scored = ~whole.isnan()
                    self.assertGreater(int(scored.sum()), 0)
                    self.assertLessEqual(float((whole[scored] - part[scored]).abs().max()), 1e-5, mode)
                self.assertIn("E_ARG mode", rep["grad"])
                self.assertIn("E_ARG values", rep["whole_row_length"])  # whole_row's input checks
                self.assertIn("E_ARG batch", rep["whole_row_plain"])
        whole = reports[1]["flex"][0]
        scored = ~whole.isnan()
        self.assertGreater(float((reports[1]["zero_exchange"][scored] - whole[scored]).abs().max()), 1e-2)


if __name__ == "__main__":
    unittest.main()
