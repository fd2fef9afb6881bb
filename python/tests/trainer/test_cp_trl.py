"""The TRL integration under context parallelism (``TreepackGRPOTrainer(context_parallel=K)``), over spawned gloo
processes on CPU (DDP through accelerate, as ``accelerate launch`` sets it up), float64.

Each process generates its own rows (test_trl_grpo's seeded ``rollout_func``: shared stems, a duplicate, a
multi-turn row with masked tool tokens, a truncated row, one prompt per process) and a CP group trains its members'
rows together, as one data-parallel rank. Against the one-process trainer on the same rows, one GRPO step for
``dapo`` (normalised by the generation batch's tokens) and ``grpo`` (per-row means), with the KL term and the
top-entropy mask, no gradient clipping:

- two processes, one group, the row split inside a radix segment: logged loss and every parameter gradient within
  1e-10 (the tolerance test_trl_grpo holds the packed trainer to against stock TRL). Negative controls: without the
  key/value exchange, without the sum of the gradients over the group, with TRL's token count not scaled to the
  group, the step differs;
- four processes, two groups of two (one split inside a segment, one at a branch point): every gradient within
  1e-10, the logged loss to float32 rounding (the Trainer averages float32 losses over processes). Control: without
  the average over the groups, the step differs.

Flex attention under CP: test_cp_flex.py. The ranks are spawned, not forked: a fork after torch's OpenMP pool has
run leaves the children waiting on it."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import unittest
from unittest import mock

from support import needs_torch, patch_norms_to_input_dtype, tiny_model, torch
from test_trl_grpo import TRL_SKIP, VOCAB, Capture, patch_rope_to_float64, reward, rollouts, tokenizer

G = 4
TOL = 1e-10


def trainer(path: str, world: int, prompts: int, loss_type: str, **extra):
    """A TreepackGRPOTrainer on ``prompts`` prompts of G rows (one generation batch, one optimizer step), split over
    ``world`` processes' generation; ``extra``: the trainer's treepack arguments. No gradient clipping: the captured
    gradients keep their scale."""
    from datasets import Dataset
    from treepack.integrations.trl import TreepackGRPOTrainer
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(path), f"out{os.getpid()}"),
        per_device_train_batch_size=G * prompts // world,
        max_grad_norm=0.0,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=G,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        mask_truncated_completions=True,
        top_entropy_quantile=0.5,
        beta=0.04,
        loss_type=loss_type,
        temperature=0.7,
        disable_tqdm=True,
        ddp_backend="gloo" if world > 1 else None,
        model_init_kwargs={"attn_implementation": "treepack", "dtype": torch.float64},
    )
    capture = Capture()
    t = TreepackGRPOTrainer(
        model=path,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(4)]}),
        processing_class=tokenizer(),
        callbacks=[capture],
        rollout_func=lambda prompts, trainer: rollouts(prompts, 0, 8),
        **extra,
    )
    for m in (t.model, t.ref_model):  # HF computes RMSNorm and RoPE angles in float32 whatever the dtype
        if m is not None:
            patch_norms_to_input_dtype(m)
            patch_rope_to_float64(m)
    return t, capture


def step(path: str, world: int, prompts: int, loss_type: str, **extra) -> dict:
    t, cap = trainer(path, world, prompts, loss_type, **extra)
    t.train()
    out = {"grads": cap.grads, "logs": cap.logs[0]}
    cp = t.__dict__.get("_treepack_cp")
    if cp is not None:
        out["bounds"] = cp.bounds
        out["wrapper"] = type(t.model_wrapped).__name__
    return out


def trl_worker(rank: int, world: int, cp: int, port: int, path: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed as dist

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
        report = {loss: step(path, world, world, loss, context_parallel=cp) for loss in ("dapo", "grpo")}
    report["split"] = splits[0]
    if world > cp:  # control: each data-parallel group keeps its own gradient (no average over the groups)
        with mock.patch.object(integration, "sync_gradients", lambda model: None):
            report["no_average"] = step(path, world, world, "dapo", context_parallel=cp)
    else:
        # Controls: the context's keys/values (and hidden rows) zero, no exchange; the gradients left as each rank's
        # share; TRL's token count over the world's processes left as gathered (the group's rows counted once).
        zero = lambda self, x, route, what: x.new_zeros((route.owner.numel(),) + tuple(x.shape[1:]))  # noqa: E731
        with mock.patch.object(LocalPart, "fetch", zero):
            report["no_exchange"] = step(path, world, world, "dapo", context_parallel=cp)
        with mock.patch.object(integration, "reduce_gradients", lambda model, cp: None):
            report["no_sum"] = step(path, world, world, "dapo", context_parallel=cp)
        rows = integration.GroupedBatchesMixin._treepack_cp_rows
        with mock.patch.object(
            integration.GroupedBatchesMixin,
            "_treepack_cp_rows",
            lambda self, x: {**rows(self, x), "num_items_in_batch": x["num_items_in_batch"]},
        ):
            report["unscaled_count"] = step(path, world, world, "dapo", context_parallel=cp)
    torch.save(report, os.path.join(out, f"trl{rank}.pt"))
    dist.destroy_process_group()


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
        """Each rank's report of ``world`` spawned processes in groups of ``cp``, and the one-process steps on the
        same rows (one prompt per process)."""
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            path = os.path.join(out, "qwen3")
            tiny_model("qwen3", torch.float32, attn="sdpa", vocab=VOCAB).save_pretrained(path)
            mp.spawn(trl_worker, args=(world, cp, free_port(), path, out), nprocs=world, join=True)
            reports = [torch.load(os.path.join(out, f"trl{r}.pt")) for r in range(world)]
            refs = {loss: step(path, 1, world, loss) for loss in ("dapo", "grpo")}
        for rep in reports:
            for loss in ("dapo", "grpo"):
                self.assertEqual(rep[loss]["wrapper"], "DistributedDataParallel")
        return reports, refs

    def bound_at(self, rep: dict) -> str:
        """Where the group's bound fell: "segment" (node lo continues lo - 1, its only child), "branch" (node lo
        starts a branch of an earlier node), else "other"."""
        parent, bounds = rep["split"]
        lo = bounds[1]
        if int(parent[lo]) == lo - 1:
            return "segment" if int((parent == lo - 1).sum()) == 1 else "other"
        return "branch" if int(parent[lo]) >= 0 else "other"

    def test_one_group(self):
        """Two ranks, one CP group: the one-process step (its logged loss exactly as the float32 sum the Trainer logs
        holds it, every gradient within 1e-10); each control differs."""
        reports, refs = self.run_ranks(2, 2)
        self.assertEqual([self.bound_at(r) for r in reports], ["segment"] * 2)
        for rank, rep in enumerate(reports):
            for loss, ref in refs.items():
                with self.subTest(rank=rank, loss=loss):
                    self.assertSameStep(ref, rep[loss], loss)
            for control in ("no_exchange", "no_sum", "unscaled_count"):
                with self.subTest(rank=rank, control=control), self.assertRaises(AssertionError):
                    self.assertSameStep(refs["dapo"], rep[control], control)
            # The token count's control scales the loss and, unclipped, every gradient.
            with self.subTest(rank=rank, control="unscaled_count gradients"), self.assertRaises(AssertionError):
                self.assertSameStep(refs["dapo"], {**rep["unscaled_count"], "logs": refs["dapo"]["logs"]}, "unscaled_count")

    def test_data_parallel_groups(self):
        """Four ranks, two CP groups of two (each group its own rows): the gradients summed over each group and
        averaged over the groups are the one-process step's within 1e-10. The logged loss is the Trainer's average
        over processes of float32 losses, which the one-process run rounds once: equal to float32's rounding
        (2^-22 relative, as test_trl_grpo holds two splits' logged losses). Without the average the groups differ."""
        reports, refs = self.run_ranks(4, 2)
        self.assertEqual([self.bound_at(r) for r in reports], ["segment"] * 2 + ["branch"] * 2)  # each group its own rows
        for rank, rep in enumerate(reports):
            for loss, ref in refs.items():
                with self.subTest(rank=rank, loss=loss):
                    self.assertSameStep(ref, rep[loss], loss, loss_tol=2**-22)
            with self.subTest(rank=rank, control="no_average"), self.assertRaises(AssertionError):
                self.assertSameStep(refs["dapo"], rep["no_average"], "no_average", loss_tol=2**-22)


if __name__ == "__main__":
    unittest.main()
