"""TRL trained on treepack micro-batches (``TreepackGRPOTrainer(packed_batches=...)``) against the same samples fed
to the stock ``GRPOTrainer`` as plain padded inputs built here: equal logged loss and metrics and every gradient
(float64), the stored forest reused (its pad nodes are seen by the forward), a multi-turn sequence whose loss mask
has holes trains exactly its trainable tokens (negative control: counted as trainable, the gradients move), and
feed micro-batches are acknowledged once TRL is done with them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import unittest
from typing import Any

import numpy as np
from support import needs_torch, pack, patch_norms_to_input_dtype, tiny_model, torch
from test_trl_grpo import PAD, TRL_SKIP, VOCAB, Capture, patch_rope_to_float64, tokenizer

CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "dist", "src", "cli", "main.js")
CLI_SKIP = "" if os.path.exists(CLI) and shutil.which("node") else f"the treepack CLI is not built ({CLI}: npm install builds it)"


def samples(seed: int) -> list[dict[str, Any]]:
    """Sequences with a prompt (loss 0), a response, per-token advantages and rollout logprobs; two micro-batches'
    worth, sharing stems; the first holds a multi-turn sequence with a hole (tool tokens) in its loss mask."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    out = []
    for mb in range(2):
        prompt = [2, 3] + tok(3)
        for k in range(5):
            resp = tok(r.randrange(1, 5)) if k else tok(2) + tok(3) + tok(2)  # k = 0: turn, tool result, turn
            mask = [0] * len(prompt) + [1] * len(resp)
            if not k:
                mask[len(prompt) + 2 : len(prompt) + 5] = [0, 0, 0]
            adv = r.gauss(0, 1)
            out.append(
                {
                    "mb": mb,
                    "tokens": prompt + resp,
                    "mask": mask,
                    "adv": [adv + 0.1 * r.random() for _ in mask],
                    "rollout": [-3 * r.random() for _ in mask],
                }
            )
    return out


def packed_batches(rows: list[dict[str, Any]], with_old: bool) -> list[Any]:
    """One PackedBatch per micro-batch (the C core's forest plus two pad nodes, as the budgeted packer lays them out)."""
    from treepack.torch import from_microbatch

    out = []
    for mb in (0, 1):
        mine = [x for x in rows if x["mb"] == mb]
        m = pack([x["tokens"] for x in mine], pad=2)
        m.loss_mask = np.array([t for x in mine for t in x["mask"]], dtype=np.uint8)
        m.advantages = np.array([a for x in mine for a in x["adv"]], dtype=np.float32)
        m.rollout_logprobs = np.array([a for x in mine for a in x["rollout"]], dtype=np.float32)
        m.old_logprobs = m.rollout_logprobs.copy() if with_old else None
        m.ref_logprobs = None
        out.append(from_microbatch(m))
    return out


def plain_inputs(rows: list[dict[str, Any]], num_items: int, with_old: bool, holes: bool = True) -> list[dict[str, Any]]:
    """TRL's inputs for each micro-batch, by hand: prompt = tokens before the first trainable one (left-padded),
    completion the rest (right-padded), tool_mask the loss mask there, per-token advantages (float32, as stored)."""
    out = []
    for mb in range(1 + max(x["mb"] for x in rows)):
        mine = [x for x in rows if x["mb"] == mb]
        cut = [x["mask"].index(1) for x in mine]
        P = max(cut)
        C = max(len(x["tokens"]) - c for x, c in zip(mine, cut))

        def right(v, c, fill, C=C):
            return v[c:] + [fill] * (C - len(v) + c)

        f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        d = {
            "prompt_ids": torch.tensor([[PAD] * (P - c) + x["tokens"][:c] for x, c in zip(mine, cut)]),
            "prompt_mask": torch.tensor([[0] * (P - c) + [1] * c for c in cut]),
            "completion_ids": torch.tensor([right(x["tokens"], c, PAD) for x, c in zip(mine, cut)]),
            "completion_mask": torch.tensor([right([1] * len(x["tokens"]), c, 0) for x, c in zip(mine, cut)]),
            "tool_mask": torch.tensor([right(x["mask"] if holes else [1] * len(x["mask"]), c, 0) for x, c in zip(mine, cut)]),
            "advantages": f32([right(x["adv"], c, 0.0) for x, c in zip(mine, cut)]),
            "sampling_per_token_logps": f32([right(x["rollout"], c, 0.0) for x, c in zip(mine, cut)]),
            "num_items_in_batch": torch.tensor(num_items),
        }
        if with_old:
            d["old_per_token_logps"] = d["sampling_per_token_logps"].clone()
        out.append(d)
    return out


def plan_samples(tmp: str, name: str, *flags: str, max_tokens: int = 12):
    """Two groups of five samples under 14-token prompts, packed by `treepack pack --max-tokens T --prefix-reuse 100`
    (and ``flags``) into ``tmp/name``: the samples and the directory."""
    r = random.Random(5)
    tok = lambda n: [r.randrange(4, VOCAB) for _ in range(n)]  # noqa: E731
    samples = []
    for _ in range(2):
        prompt = [2, 3] + tok(12)
        for k in range(5):
            resp = tok(r.randrange(2, 6)) if k else tok(2) + tok(3) + tok(2)
            mask = [0] * len(prompt) + [1] * len(resp)
            if not k:
                mask[len(prompt) + 2 : len(prompt) + 5] = [0, 0, 0]
            samples.append(
                {"tokens": prompt + resp, "mask": mask, "adv": [r.gauss(0, 1)] * len(mask), "rollout": [-3 * r.random() for _ in mask]}
            )
    data, out = os.path.join(tmp, f"{name}.jsonl"), os.path.join(tmp, name)
    with open(data, "w") as f:
        for i, x in enumerate(samples):
            f.write(
                json.dumps(
                    {
                        "id": f"s{i}",
                        "group": f"g{i // 5}",
                        "tokens": x["tokens"],
                        "loss_mask": x["mask"],
                        "advantages": x["adv"],
                        "rollout_logprobs": x["rollout"],
                    }
                )
                + "\n"
            )
    subprocess.run(
        ["node", CLI, "pack", data, "--out", out, "--max-tokens", str(max_tokens), "--prefix-reuse", "100", "--quiet", *flags], check=True
    )
    return samples, out


def Capture_of(step):
    """A (grads, logs) pair saved by a worker, as assertSameStep reads a Capture."""
    return type("Step", (), {"grads": step[0], "logs": step[1]})


class FeedItem:
    """A stand-in for treepack.client.FeedMicroBatch: the batch, and an ack the test can see."""

    def __init__(self, batch, acks: list[int], i: int):
        self.batch, self.acks, self.i = batch, acks, i

    def ack(self):
        self.acks.append(self.i)


@needs_torch(transformers=True)
@unittest.skipIf(bool(TRL_SKIP), TRL_SKIP)
class TRLOnMicroBatchesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.tok = tokenizer()
        cls.path = os.path.join(cls.tmp.name, "qwen3")
        tiny_model("qwen3", torch.float32, attn="sdpa", vocab=VOCAB).save_pretrained(cls.path)
        cls.rows = samples(0)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_trainer(
        self,
        packed: bool,
        with_old: bool,
        holes: bool = True,
        feed: Any = None,
        rows: Any = None,
        num_items: Any = None,
        world: int = 1,
        **cfg,
    ):
        from treepack.integrations.trl import TreepackGRPOTrainer
        from trl import GRPOConfig, GRPOTrainer

        rows = self.rows if rows is None else rows
        steps = 1 + max(x["mb"] for x in rows)  # micro-batches: one optimizer step over them
        args = dict(
            output_dir=self.tmp.name,
            per_device_train_batch_size=5,
            gradient_accumulation_steps=steps,
            steps_per_generation=steps,
            num_generations=5,
            max_completion_length=8,
            max_steps=1,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
            use_cpu=True,
            beta=0.04,
            loss_type="dapo",
            temperature=0.7,
            disable_tqdm=True,
            model_init_kwargs={"attn_implementation": "treepack" if packed else "sdpa", "dtype": torch.float64},
        )
        args.update(cfg)
        if self.path.endswith("qwen3_moe"):  # grouped_mm refuses float64
            args["model_init_kwargs"] = {**args["model_init_kwargs"], "experts_implementation": "eager"}
        capture = Capture()
        num_items = sum(sum(x["mask"]) for x in rows) if num_items is None else num_items  # over every rank's rows
        if packed:
            t = TreepackGRPOTrainer(
                model=self.path,
                args=GRPOConfig(**args),
                processing_class=self.tok,
                callbacks=[capture],
                packed_batches=feed if feed is not None else packed_batches(rows, with_old),
            )
        else:
            inputs = plain_inputs(rows, num_items, with_old, holes)

            class Plain(GRPOTrainer):
                """TRL's stock forwards on the plain inputs; old and reference logprobs where TRL computes them (one
                optimizer step: the policy is still the one before it)."""

                def _prepare_inputs(self, generation_batch):
                    d = dict(inputs[self._step % steps])
                    ids = torch.cat([d["prompt_ids"], d["completion_ids"]], 1)
                    att = torch.cat([d["prompt_mask"], d["completion_mask"]], 1)
                    C = d["completion_ids"].shape[1]
                    with torch.no_grad():
                        if "old_per_token_logps" not in d and self.num_iterations > 1:
                            d["old_per_token_logps"] = self._get_per_token_logps_and_entropies(self.model, ids, att, C)[0]
                        d["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(self.ref_model, ids, att, C)[0]
                    return d

            from datasets import Dataset

            t = Plain(
                model=self.path,
                reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                args=GRPOConfig(**args),
                train_dataset=Dataset.from_dict({"prompt": [""] * 5 * steps * world}),
                processing_class=self.tok,
                callbacks=[capture],
            )
        for m in (t.model, t.ref_model):
            if m is not None:
                patch_norms_to_input_dtype(m)
                patch_rope_to_float64(m)
        t.train()
        return t, capture

    def assertSameStep(self, a, b, tol=1e-10):
        self.assertIn("loss", a.logs[0])
        for k, v in a.logs[0].items():
            if "time" not in k and "per_second" not in k:
                self.assertAlmostEqual(b.logs[0][k], v, delta=tol * max(1.0, abs(v)), msg=f"logged {k}")
        self.assertEqual(sorted(a.grads), sorted(b.grads))
        for n, g in a.grads.items():
            self.assertLessEqual(float((b.grads[n] - g).abs().max()), tol * max(1.0, float(g.abs().max())), f"gradient of {n}")

    def test_equal_to_plain_inputs(self):
        for loss, with_old, iters in (("dapo", True, 1), ("grpo", False, 2), ("cispo", False, 1), ("bnpo", True, 2)):
            with self.subTest(loss=loss, stored_old=with_old, num_iterations=iters):
                plain, p_cap = self.run_trainer(False, with_old, loss_type=loss, num_iterations=iters)
                packed, k_cap = self.run_trainer(True, with_old, loss_type=loss, num_iterations=iters)
                self.assertSameStep(p_cap, k_cap)
                # The stored forests were reused: the forwards saw their two pad nodes.
                stored = packed_batches(self.rows, with_old)
                self.assertTrue(packed.treepack_stats)
                self.assertTrue(set(n for _, n in packed.treepack_stats) <= {b.num_nodes for b in stored})
                self.assertTrue(all(b.num_pad_tokens == 2 for b in stored))

    @unittest.skipIf(bool(CLI_SKIP), CLI_SKIP)
    def test_packed_directory(self):
        """Samples packed by `treepack pack` (its own budgeted micro-batches), read by PackedDataset, trained by TRL:
        the same step as the same samples, micro-batch by micro-batch, fed as plain inputs."""
        from treepack.torch import PackedDataset

        data, out = os.path.join(self.tmp.name, "samples.jsonl"), os.path.join(self.tmp.name, "packed")
        with open(data, "w") as f:
            for i, x in enumerate(self.rows):
                f.write(
                    json.dumps(
                        {
                            "id": f"s{i}",
                            "group": f"g{i // 5}",
                            "tokens": x["tokens"],
                            "loss_mask": x["mask"],
                            "advantages": x["adv"],
                            "rollout_logprobs": x["rollout"],
                        }
                    )
                    + "\n"
                )
        subprocess.run(["node", CLI, "pack", data, "--out", out, "--max-tokens", "40", "--quiet"], check=True)
        dataset = PackedDataset(out)
        batches = list(dataset)
        self.assertGreaterEqual(len(batches), 2)
        # The plain side takes the CLI's micro-batch composition (its sequence ids), in its sequence order.
        rows = []
        for mb, b in enumerate(batches[:2]):
            for sid in b.meta["sequence_ids"]:
                rows.append(dict(self.rows[int(sid[1:])], mb=mb))
        _, plain = self.run_trainer(False, False, rows=rows)
        packed, cap = self.run_trainer(True, False, feed=dataset, rows=rows)
        self.assertSameStep(plain, cap)
        self.assertTrue(set(n for _, n in packed.treepack_stats) <= {b.num_nodes for b in batches})

    @unittest.skipIf(bool(CLI_SKIP), CLI_SKIP)
    def test_step_plan_directory(self):
        """Samples packed with a step plan (`treepack pack --prefix-reuse`: prompts of 14 tokens, 12 computed tokens
        per micro-batch, so micro-batches hang from a cached prompt, and the two groups' common first tokens feed all of
        them), trained by TRL through the step-plan executor: the same step (loss, every logged metric, entropy
        included, every gradient) as the same micro-batches fed as plain inputs, for two loss types."""
        from treepack.torch import PackedDataset

        samples, out = plan_samples(self.tmp.name, "planned")
        dataset = PackedDataset(out)
        batches = list(dataset)
        self.assertEqual(
            [int(b.meta["prefix_tokens"]) for b in batches], [14] * len(batches)
        )  # every micro-batch hangs from a cached prompt
        self.assertGreaterEqual(len(batches), 4)
        rows = [dict(samples[int(sid[1:])], mb=mb) for mb, b in enumerate(batches) for sid in b.meta["sequence_ids"]]
        for loss in ("dapo", "grpo"):
            with self.subTest(loss=loss):
                _, plain = self.run_trainer(False, False, rows=rows, loss_type=loss)
                packed, cap = self.run_trainer(True, False, feed=dataset, rows=rows, loss_type=loss)
                self.assertSameStep(plain, cap)
                runner = packed.__dict__["_treepack_plan"]
                self.assertEqual((runner.pushed, runner.computed), (dataset.manifest["pushed_tokens"], dataset.manifest["computed_tokens"]))
                self.assertEqual(runner.stack, [])
        # Negative control: without the pops (the cached prompts' gradients dropped) the step differs.
        from treepack.torch import StepPlanRunner

        def drop(self_):  # the released segments leave the stack unpopped
            del self_.stack[len(self_.stack) - self_.pending :]
            self_.pending = None

        release, StepPlanRunner.release = StepPlanRunner.release, drop
        try:
            _, dropped = self.run_trainer(True, False, feed=dataset, rows=rows)
        finally:
            StepPlanRunner.release = release
        with self.assertRaises(AssertionError):
            self.assertSameStep(plain, dropped)
        # An optimizer step inside the plan (after 2 of its micro-batches, the prompt still cached) is refused.
        with self.assertRaisesRegex(ValueError, "gradient_accumulation_steps"):
            self.run_trainer(True, False, feed=dataset, rows=rows, gradient_accumulation_steps=2, steps_per_generation=2, max_steps=2)

    @unittest.skipIf(bool(CLI_SKIP), CLI_SKIP)
    def test_step_plan_directory_with_the_moe_aux_loss(self):
        """The step plan above through a tiny Qwen3-MoE with TRL's router load-balancing loss on: the same step (loss,
        aux_loss, every gradient, the routers' included) as the micro-batches fed as plain inputs; the cached prompts'
        router logits count in every micro-batch hanging from them (StepPlanRunner(router=True)). The router's softmax
        and transformers' aux loss run in float64 on both sides (test_trl_grpo.test_moe_aux_loss)."""
        from unittest import mock

        import transformers.models.qwen3_moe.modeling_qwen3_moe as qm
        from test_trl_grpo import aux_float64, router_in_input_dtype, tiny_moe
        from treepack.torch import PackedDataset

        samples, out = plan_samples(self.tmp.name, "planned-moe")
        dataset = PackedDataset(out)
        rows = [dict(samples[int(sid[1:])], mb=mb) for mb, b in enumerate(dataset) for sid in b.meta["sequence_ids"]]
        path, self.path = self.path, os.path.join(self.tmp.name, "qwen3_moe")
        tiny_moe().save_pretrained(self.path)
        try:
            with (
                mock.patch.object(qm.Qwen3MoeTopKRouter, "forward", router_in_input_dtype),
                mock.patch.object(qm, "load_balancing_loss_func", aux_float64),
            ):
                _, plain = self.run_trainer(False, False, rows=rows, router_aux_loss_coef=0.5)
                packed, cap = self.run_trainer(True, False, feed=dataset, rows=rows, router_aux_loss_coef=0.5)
        finally:
            self.path = path
        self.assertIn("aux_loss", plain.logs[0])
        self.assertSameStep(plain, cap)
        self.assertTrue(any("mlp.gate" in n for n in cap.grads))
        runner = packed.__dict__["_treepack_plan"]
        self.assertTrue(runner.router)
        self.assertGreater(runner.pushed, 0)

    @unittest.skipIf(bool(CLI_SKIP), CLI_SKIP)
    def test_step_plan_under_ddp(self):
        """Two processes (gloo, CPU, DDP through accelerate), each training its rank's micro-batches of a plan packed
        with `--dp 2 --prefix-reuse` through the step-plan executor: the same step on both ranks (loss, every logged
        metric, every gradient) as TRL's stock GRPOTrainer under DDP on the same micro-batches fed as plain inputs;
        without the one all-reduce after the last pops each rank keeps its own gradient (the control)."""
        import socket

        import ddp_trl
        import torch.multiprocessing as mp

        samples, out = plan_samples(self.tmp.name, "planned-dp2", "--dp", "2", max_tokens=8)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(ddp_trl.worker, args=(2, port, self.path, out, samples, self.tmp.name), nprocs=2, join=True)
        reports = [torch.load(os.path.join(self.tmp.name, f"rank{r}.pt")) for r in range(2)]
        for rank, rep in enumerate(reports):
            self.assertEqual(rep["wrapper"], "DistributedDataParallel")
            self.assertGreater(rep["pushed"], 0)
            plain, planned, unsynced = (Capture_of(rep[k]) for k in ("plain", "planned", "unsynced"))
            with self.subTest(rank=rank):
                self.assertSameStep(plain, planned)
                for n, g in reports[0]["planned"][0].items():  # every rank ends the step with the same gradient
                    self.assertLessEqual(float((planned.grads[n] - g).abs().max()), 1e-10 * max(1.0, float(g.abs().max())), n)
                with self.assertRaises(AssertionError):
                    self.assertSameStep(plain, unsynced)

    def test_loss_mask_holes(self):
        """Negative control: the same samples with the tool tokens counted as trainable give other gradients."""
        _, holes = self.run_trainer(False, True, holes=True)
        _, filled = self.run_trainer(False, True, holes=False)
        diff = max(float((holes.grads[n] - g).abs().max()) for n, g in filled.grads.items())
        self.assertGreater(diff, 1e-6)

    def test_feed_acks(self):
        acks: list[int] = []
        feed = [FeedItem(b, acks, i) for i, b in enumerate(packed_batches(self.rows, True))]
        self.run_trainer(True, True, feed=feed)
        self.assertEqual(acks, [0, 1])


if __name__ == "__main__":
    unittest.main()
