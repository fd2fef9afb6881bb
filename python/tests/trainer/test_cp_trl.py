"""The TRL integration under context parallelism (``TreepackGRPOTrainer(context_parallel=K)``), over spawned gloo
processes on CPU (DDP through accelerate, as ``accelerate launch`` sets it up), float64.

Each process generates its own rows (test_trl_grpo's seeded ``rollout_func``: shared stems, a duplicate, a
multi-turn row with masked tool tokens, a truncated row; two micro-batches of accumulation, old logprobs computed at
generation) and a CP group trains its members' rows together, as one data-parallel rank. One GRPO step for ``dapo``
(normalised by the generation batch's tokens) and ``grpo`` (per-row means), with the KL term and the top-entropy
mask, no gradient clipping:

- two processes, one group, the row split inside a radix segment: logged loss and every parameter gradient within
  1e-10 (the tolerance test_trl_grpo holds the packed trainer to against stock TRL), also on test_trl_packed's stored
  micro-batches given to both. Negative controls: without the key/value exchange, without the sum of the gradients
  over the group, with TRL's token count not scaled to the group, the step differs. Refused: a step plan's
  micro-batch, a group size the world does not split into;
- four processes, two groups of two (splits inside segments and at a branch point): logged loss and every gradient
  within 1e-10 of TRL under DDP over two processes without CP, each holding one group's rows (the one-process run
  plans other micro-batches, by definition). Control: without the average over the groups, the step differs.

Flex attention under CP: test_cp_flex.py. The ranks are spawned, not forked: a fork after torch's OpenMP pool has
run leaves the children waiting on it."""

from __future__ import annotations

import datetime
import functools
import os
import socket
import tempfile
import unittest
from unittest import mock

from support import needs_torch, tiny_model, torch
from test_trl_grpo import TRL_SKIP, VOCAB, tokenizer

G = 4
TOL = 1e-10


def step(path: str, world: int, loss_type: str, cp: int = 1) -> dict:
    """One optimizer step of test_trl_grpo's packed trainer (its four prompts of G rows, two micro-batches of
    accumulation, num_iterations 2: old logprobs computed at generation) with ``context_parallel=cp``, the generation
    batch split over ``world`` processes; the KL term on, the top-entropy mask at 0.3 (not the median, which a group's
    tokens counted twice would keep), no gradient clipping (the gradients keep their scale)."""
    import treepack.integrations.trl as integration
    from test_trl_grpo import TRLGRPOTest

    t = TRLGRPOTest("test_loss_types")
    t.tmp = type("Tmp", (), {"name": os.path.join(os.path.dirname(path), f"out{os.getpid()}")})()
    t.tok, t.paths = tokenizer(), {"qwen3": path}
    cfg = dict(per_device_train_batch_size=2 * G // world, max_grad_norm=0.0, beta=0.04, loss_type=loss_type, top_entropy_quantile=0.3)
    with mock.patch.object(integration, "TreepackGRPOTrainer", functools.partial(integration.TreepackGRPOTrainer, context_parallel=cp)):
        trainer, cap = t.trained(True, **cfg, **({"ddp_backend": "gloo"} if world > 1 else {}))
    out = {"grads": cap.grads, "logs": cap.logs[0]}
    if cp > 1:
        out["wrapper"] = type(trainer.model_wrapped).__name__
    return out


def trl_worker(rank: int, world: int, cp: int, controls: bool, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from ddp_trl import launch_env

    launch_env(rank, world, port)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # accelerate takes it as it is
    import treepack.integrations.trl as integration
    from treepack.torch.context_parallel import LocalPart

    splits = []
    split = integration.split_batch

    def recorded(batch, cp):
        splits.append((batch.parent.clone(), cp.bounds))
        return split(batch, cp)

    with mock.patch.object(integration, "split_batch", recorded):
        report = {loss: step(path, world, loss, cp) for loss in ("dapo", "grpo")}
    report["splits"] = splits
    if controls and world > cp:  # control: each data-parallel group keeps its own gradient (no average over the groups)
        with mock.patch.object(integration, "sync_gradients", lambda model: None):
            report["no_average"] = step(path, world, "dapo", cp)
    elif controls:
        # Controls: the context's keys/values (and hidden rows) zero, no exchange; the gradients left as each rank's
        # share; TRL's token count over the world's processes left as gathered (the group's rows counted once).
        zero = lambda self, x, route, what: x.new_zeros((route.owner.numel(),) + tuple(x.shape[1:]))  # noqa: E731
        with mock.patch.object(LocalPart, "fetch", zero):
            report["no_exchange"] = step(path, world, "dapo", cp)
        with mock.patch.object(integration, "reduce_gradients", lambda model, cp: None):
            report["no_sum"] = step(path, world, "dapo", cp)
        rows = integration.GroupedBatchesMixin._treepack_cp_rows
        with mock.patch.object(
            integration.GroupedBatchesMixin,
            "_treepack_cp_rows",
            lambda self, x: {**rows(self, x), "num_items_in_batch": x["num_items_in_batch"]},
        ):
            report["unscaled_count"] = step(path, world, "dapo", cp)
        report["stored"] = stored_step(path, world, cp)
        report["refused"] = refusals(path, world)
    torch.save(report, os.path.join(out, f"trl{cp}-{rank}.pt"))
    dist.destroy_process_group()


def stored_step(path: str, world: int, cp: int, planned: bool = False) -> dict:
    """One optimizer step of test_trl_packed's trainer on its two stored micro-batches (pad nodes, a loss mask with
    holes, stored rollout and old logprobs), every rank of a CP group given the same ones, no gradient clipping;
    ``planned``: the micro-batches marked as a step plan's."""
    import treepack.integrations.trl as integration
    from test_trl_packed import TRLOnMicroBatchesTest, packed_batches, samples

    t = TRLOnMicroBatchesTest("test_feed_acks")
    t.tmp = type("Tmp", (), {"name": os.path.join(os.path.dirname(path), f"out{os.getpid()}")})()
    t.tok, t.path, t.rows = tokenizer(), path, samples(0)
    feed = packed_batches(t.rows, True)
    for b in feed if planned else []:
        b.meta["prefix_tokens"] = 1
    with mock.patch.object(integration, "TreepackGRPOTrainer", functools.partial(integration.TreepackGRPOTrainer, context_parallel=cp)):
        _, cap = t.run_trainer(True, True, feed=feed, max_grad_norm=0.0, **({"ddp_backend": "gloo"} if world > 1 else {}))
    return {"grads": cap.grads, "logs": cap.logs[0]}


def refusals(path: str, world: int) -> dict[str, str]:
    """What the trainer says to a group size the world does not split into, and to a step plan's micro-batch."""
    import treepack.integrations.trl as integration
    from test_trl_grpo import TRLGRPOTest
    from treepack import TreepackError

    t = TRLGRPOTest("test_loss_types")
    t.tmp = type("Tmp", (), {"name": os.path.join(os.path.dirname(path), f"out{os.getpid()}")})()
    t.tok, t.paths = tokenizer(), {"qwen3": path}
    out = {}
    try:
        with mock.patch.object(
            integration, "TreepackGRPOTrainer", functools.partial(integration.TreepackGRPOTrainer, context_parallel=world + 1)
        ):
            t.trainer(True, per_device_train_batch_size=2 * G // world, **({"ddp_backend": "gloo"} if world > 1 else {}))
        out["size"] = "accepted"
    except TreepackError as e:
        out["size"] = f"{e.field}: {e}"
    if world > 1:
        try:
            stored_step(path, world, world, planned=True)
            out["planned"] = "ran"
        except TreepackError as e:
            out["planned"] = f"{e.field}: {e}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_torch(transformers=True)
@unittest.skipIf(bool(TRL_SKIP), TRL_SKIP)
class CPTRLTest(unittest.TestCase):
    def assertSameStep(self, ref: dict, got: dict, what: str, loss_tol: float = TOL) -> None:
        loss = ref["logs"]["loss"]
        self.assertAlmostEqual(got["logs"]["loss"], loss, delta=loss_tol * max(1.0, abs(loss)), msg=f"{what}: loss")
        self.assertTrue(ref["grads"])
        self.assertEqual(sorted(ref["grads"]), sorted(got["grads"]))
        for n, g in ref["grads"].items():
            err = float((got["grads"][n] - g).abs().max())
            self.assertLessEqual(err, TOL * max(1.0, float(g.abs().max())), f"{what}: gradient of {n}")

    def run_ranks(self, world: int, cp: int) -> tuple[list[dict], dict]:
        """Each rank's report of ``world`` spawned processes in groups of ``cp``, and the reference steps on the same
        rows: TRL under DDP over world / cp processes without CP, each with the rows of a group (one process: no
        DDP)."""
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            path = os.path.join(out, "qwen3")
            tiny_model("qwen3", torch.float32, attn="sdpa", vocab=VOCAB).save_pretrained(path)
            mp.spawn(trl_worker, args=(world, cp, True, free_port(), path, out), nprocs=world, join=True)
            reports = [torch.load(os.path.join(out, f"trl{cp}-{r}.pt")) for r in range(world)]
            if world == cp:
                refs = {loss: step(path, 1, loss) for loss in ("dapo", "grpo")}
                refs["stored"] = stored_step(path, 1, 1)
            else:
                mp.spawn(trl_worker, args=(world // cp, 1, False, free_port(), path, out), nprocs=world // cp, join=True)
                refs = torch.load(os.path.join(out, "trl1-0.pt"))
        for rep in reports:
            for loss in ("dapo", "grpo"):
                self.assertEqual(rep[loss]["wrapper"], "DistributedDataParallel")
        return reports, refs

    def test_refused_alone(self):
        """One process cannot hold a group of two; a group size that is not an integer >= 1 is refused."""
        from treepack import TreepackError

        with tempfile.TemporaryDirectory() as out:
            path = os.path.join(out, "qwen3")
            tiny_model("qwen3", torch.float32, attn="sdpa", vocab=VOCAB).save_pretrained(path)
            self.assertIn("world's 1 processes do not split into groups of 2", refusals(path, 1)["size"])
            with self.assertRaises(TreepackError) as e:
                step(path, 1, "dapo", cp=0)
            self.assertEqual(e.exception.field, "context_parallel")

    def bounds_at(self, rep: dict) -> set[str]:
        """Where the rank's splits of its training forwards fell: "segment" (node lo continues lo - 1, its only
        child), "branch" (node lo starts a branch of an earlier node), "root"."""
        kinds = set()
        for parent, bounds in rep["splits"]:
            lo = bounds[1]
            if int(parent[lo]) == lo - 1:
                kinds.add("segment" if int((parent == lo - 1).sum()) == 1 else "branch point's first child")
            else:
                kinds.add("branch" if int(parent[lo]) >= 0 else "root")
        return kinds

    def test_one_group(self):
        """Two ranks, one CP group: the one-process step (logged loss and every gradient within 1e-10), on generated
        rows and on stored micro-batches; each control differs; a step plan's micro-batch and a group size the world
        does not split into are refused."""
        reports, refs = self.run_ranks(2, 2)
        for rep in reports:
            self.assertIn("segment", self.bounds_at(rep))
        for rank, rep in enumerate(reports):
            for run, ref in refs.items():  # generated rows (dapo, grpo) and stored micro-batches (dapo)
                with self.subTest(rank=rank, run=run):
                    self.assertSameStep(ref, rep[run], run)
            for control in ("no_exchange", "no_sum", "unscaled_count"):
                with self.subTest(rank=rank, control=control), self.assertRaises(AssertionError):
                    self.assertSameStep(refs["dapo"], rep[control], control)
            self.assertRegex(rep["refused"]["size"], r"^context_parallel: .*world's 2 processes do not split into groups of 3")
            self.assertRegex(rep["refused"]["planned"], r"^context_parallel: .*a step plan's micro-batch")
            # The token count's control scales the loss and, unclipped, every gradient.
            with self.subTest(rank=rank, control="unscaled_count gradients"), self.assertRaises(AssertionError):
                self.assertSameStep(refs["dapo"], {**rep["unscaled_count"], "logs": refs["dapo"]["logs"]}, "unscaled_count")

    def test_data_parallel_groups(self):
        """Four ranks, two CP groups of two (each group its own rows): the step of TRL under DDP over two processes
        holding the same rows, without CP (logged loss and every gradient within 1e-10): the gradients summed over
        each group and averaged over the groups. Without the average the groups differ."""
        reports, refs = self.run_ranks(4, 2)
        self.assertEqual([sorted(self.bounds_at(r)) for r in reports], [["branch", "segment"]] * 2 + [["segment"]] * 2)
        for rank, rep in enumerate(reports):
            for loss in ("dapo", "grpo"):
                with self.subTest(rank=rank, loss=loss):
                    self.assertSameStep(refs[loss], rep[loss], loss)
            with self.subTest(rank=rank, control="no_average"), self.assertRaises(AssertionError):
                self.assertSameStep(refs["dapo"], rep["no_average"], "no_average")


if __name__ == "__main__":
    unittest.main()
