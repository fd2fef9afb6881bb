"""FSDP over gloo on CPU: two processes, each with its own packed micro-batch, run ``forward_logprobs`` through
the sharded model's own forward (FSDP1 ``FullyShardedDataParallel`` and FSDP2 ``fully_shard``, which gather the
parameters there) and back-propagate a GRPO-like loss; every gathered weight gradient equals (float64, within
1e-10 of the largest) the gradient of one process running every rank's sequences unpacked (each alone, SDPA
causal), averaged over the ranks as FSDP averages. Control: rank 0's sequences alone give another gradient, so
both ranks' data is in it. The step-plan executor refuses both wrappers (it calls the layers itself, bypassing
their parameter gathering).

The ranks are spawned, not forked: a fork after this process has run torch's OpenMP thread pool (setUpClass, or any
suite before this one) leaves the children waiting on that pool forever."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import unittest

from support import forests, needs_torch, pack, tiny_model, torch, tpt
from test_exactness import objective, unpacked_logprobs
from treepack import TreepackError

VOCAB = 97
WORLD = 2


def rank_batch(rank: int):
    """Rank ``rank``'s micro-batch: its own forest shape (deep and wide branching on the two ranks)."""
    shapes = list(forests(VOCAB, seed=3).values())
    return tpt.load_microbatch(pack(shapes[rank], seed=rank))


def shard(model, kind: str):
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)


def full_grads(wrapped, kind: str):
    """{parameter name as in the unwrapped model: its whole gradient}, gathered from the shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    gather = FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True) if kind == "fsdp1" else contextlib.nullcontext()
    with gather:
        out = {}
        for name, p in wrapped.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name.replace("_fsdp_wrapped_module.", "")] = g.tolist()
        return out


def worker(rank: int, kind: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=WORLD)
    try:
        wrapped = shard(tiny_model("qwen3", torch.float64, vocab=VOCAB), kind)  # the same seed: the same weights everywhere
        batch = rank_batch(rank)
        scores = tpt.forward_logprobs(wrapped, batch, nodes="all", entropy=True)
        objective(tpt.gather_occurrences(scores.logprobs, batch), tpt.gather_occurrences(scores.entropy, batch), batch).backward()
        grads = full_grads(wrapped, kind)
        try:
            tpt.StepPlanRunner(wrapped)
            refused = ""
        except TreepackError as e:
            refused = str(e)
        if rank == 0:
            with open(os.path.join(out, f"{kind}.json"), "w") as f:
                json.dump({"grads": grads, "refused": refused}, f)
    finally:
        dist.destroy_process_group()


@needs_torch(transformers=True)
class FullyShardedOverGloo(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        """The reference: every rank's sequences unpacked in this process, the loss averaged over the ranks; and
        rank 0's alone (the control)."""
        model = tiny_model("qwen3", torch.float64, attn="sdpa", vocab=VOCAB)
        cls.reference, cls.rank0_only = {}, {}
        losses = [objective(*unpacked_logprobs(model, rank_batch(r)), rank_batch(r)) for r in range(WORLD)]
        for target, loss in ((cls.reference, sum(losses) / WORLD), (cls.rank0_only, losses[0] / WORLD)):
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            target.update({n: p.grad.clone() for n, p in model.named_parameters()})

    def run_ranks(self, kind: str) -> dict:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(worker, args=(kind, out), nprocs=WORLD, join=True, start_method="spawn")
            with open(os.path.join(out, f"{kind}.json")) as f:
                return json.load(f)

    def check(self, kind: str) -> None:
        got = self.run_ranks(kind)
        self.assertEqual(set(got["grads"]), set(self.reference))
        worst = control = 0.0
        for name, ref in self.reference.items():
            g = torch.tensor(got["grads"][name], dtype=torch.float64)
            worst = max(worst, float((g - ref).abs().max()))
            control = max(control, float((g - self.rank0_only[name]).abs().max()))
        scale = max(float(g.abs().max()) for g in self.reference.values())
        print(f"{kind}: largest gradient difference {worst:.1e} (largest gradient {scale:.1e}); rank 0 alone differs by {control:.1e}")
        self.assertLess(worst, 1e-10 * scale)
        self.assertGreater(control, 1e-3 * scale)
        self.assertIn("the step-plan executor runs the model's layers itself", got["refused"])

    def test_fsdp2_packed_gradients_equal_the_unpacked_run(self):
        self.check("fsdp2")

    def test_fsdp1_packed_gradients_equal_the_unpacked_run(self):
        self.check("fsdp1")


if __name__ == "__main__":
    unittest.main()
