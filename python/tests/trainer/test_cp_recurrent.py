"""Recurrent layers under context parallelism (python/treepack/torch/cp_recurrent.py): three gloo processes (spawned,
not forked) split one packed row (``context_parallel`` + ``split_batch``) and run ``packed_logprobs``, ``PackedLoss``
and backward on their local parts through tiny float64 hybrid models of the real transformers classes: Qwen3.5 (Gated
DeltaNet + attention), Nemotron-H (Mamba2 + attention + MLP) and Kimi Linear (KDA + MLA attention). Per-token
logprobs, the loss and every parameter gradient (``reduce_gradients``) equal the one-rank run within 1e-10. The
splits put a rank boundary inside a segment, at a branch point, under a branch point two ranks back, across a
segment spanning three ranks whose middle rank holds fewer tokens than the convolution's window; one gives a rank no
scored token; one runs in a sub-group whose ranks are not the world's. Negative controls: without the state hand-over,
or without the convolution windows' hand-over, the logprobs differ. A rank that fails: the others raise a
TreepackError naming it within the group's timeout, no hang; chunk alignment, gradient checkpointing and unsupported
mixers are refused."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import unittest

from support import needs_torch, pack, spawned_ranks, torch, tpt
from test_hybrid import VOCAB, hybrid_model
from treepack import TreepackError

WORLD = 3
TOL = 1e-10
# Splits of the forest below (N = 38, then 2 pad nodes) over the ranks, and what each stresses (checked in CheckedSplits).
SPLITS = {
    "branch": [0, 13, 28, 40],  # 13 starts under branch point 12; 28 continues 27's segment; 29 hangs from 12 on rank 0
    "three": [0, 15, 17, 40],  # segment 13..18 spans all three ranks; rank 1 holds 2 < K - 1 tokens
    "unscored": [0, 13, 28, 40],  # as "branch", with rank 1's occurrences untrained
}
GROUP_SPLIT = [0, 20, 40]  # over the sub-group of world ranks 1 and 2
FAMILIES = ("qwen3_5", "nemotron_h", "kimi_linear")
CONFIG = {"clip_low": 0.2, "clip_high": 0.28, "kl": "k3", "kl_coef": 0.1}


def forest() -> list[list[int]]:
    r = random.Random(0)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(12)
    return [stem + tok(5), stem[:6] + tok(9), stem[:6] + tok(2), stem + tok(3), tok(4), stem[:1] + tok(3)]


def row(name: str = ""):
    batch = tpt.load_microbatch(pack(forest(), pad=2, seed=1))
    if name == "unscored":
        lo, hi = SPLITS[name][1:3]
        batch.loss_mask[(batch.seq_positions >= lo) & (batch.seq_positions < hi)] = False
    return batch


def run(model, batch, group=None, bounds=None, grad: bool = True) -> dict:
    """One run of ``batch`` (split over ``group`` at ``bounds``; one rank when None): the logprobs of the nodes this
    rank computes, the row's loss, and the parameter gradients summed over the group."""
    model.zero_grad(set_to_none=True)
    local, lo = batch, 0
    if bounds is not None:
        cp = tpt.ContextParallel.of(batch, group=group, bounds=bounds)
        local, lo = tpt.split_batch(batch, cp), cp.lo
    with torch.set_grad_enabled(grad):
        lp = tpt.packed_logprobs(model, local, nodes="all").logprobs
        loss, metrics = tpt.PackedLoss.apply(lp, local, CONFIG)
        if grad:
            loss.backward()
    if bounds is not None:
        lp = lp[local.context_parallel.rows :]
        if grad:
            tpt.reduce_gradients(model, cp)
    return {
        "lo": lo,
        "lp": lp.detach(),
        "loss": float(metrics[0]),
        "scored": int(local.loss_mask.sum()),
        "grads": {n: p.grad for n, p in model.named_parameters()} if grad else None,
    }


def without(kind: str):
    """The negative controls' plans: no state hand-over (hanging roots start from zeros) or no window hand-over
    (windows read zeros where they reach an earlier rank); every rank drops its messages alike."""
    from treepack.torch import cp_recurrent

    if kind == "state":
        orig = cp_recurrent.state_plan
        return cp_recurrent, "state_plan", lambda *a: dataclasses.replace(orig(*a), recv=[], send=[])
    orig_conv = cp_recurrent.conv_plan

    def conv_plan(*a):
        p = orig_conv(*a)
        w = torch.where(p.windows < p.imports, -1, p.windows - p.imports)
        return dataclasses.replace(p, recv=[], send=[], imports=0, windows=w)

    return cp_recurrent, "conv_plan", conv_plan


def refused(call) -> str:
    try:
        call()
        return ""
    except TreepackError as e:
        return str(e)


def failing(rank: int) -> str:
    """Rank 1 fails before its forward; the others must raise, naming the exchange, within the group's 5 s timeout."""
    import torch.distributed as dist

    group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=5))
    model, batch = hybrid_model("qwen3_5"), row()
    local = tpt.split_batch(batch, tpt.ContextParallel.of(batch, group=group, bounds=SPLITS["branch"]))
    if rank == 1:
        return "rank 1 failed on purpose"
    with torch.no_grad():
        return refused(lambda: tpt.packed_logprobs(model, local))


def worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        sub = dist.new_group([1, 2])
        got: dict = {"runs": {}, "controls": {}}
        for family in FAMILIES:
            model = hybrid_model(family)
            for name, bounds in SPLITS.items():
                got["runs"][family, name] = run(model, row(name), None, bounds)
            if rank > 0:
                got["runs"][family, "group"] = run(model, row(), sub, GROUP_SPLIT)
        model = hybrid_model("qwen3_5")
        for kind in ("state", "conv"):
            module, name, fn = without(kind)
            orig = getattr(module, name)
            setattr(module, name, fn)
            try:
                got["controls"][kind] = run(model, row(), None, SPLITS["three"], grad=False)
            finally:
                setattr(module, name, orig)
        batch = row()
        local = tpt.split_batch(batch, tpt.ContextParallel.of(batch, bounds=SPLITS["branch"]))
        got["chunk_align"] = refused(lambda: tpt.packed_logprobs(tpt.prepare(hybrid_model("qwen3_5"), chunk_align=True), local))
        model = hybrid_model("qwen3_5").train()
        model.gradient_checkpointing_enable()
        got["checkpointing"] = refused(lambda: tpt.packed_logprobs(model, local, nodes="all").logprobs.nansum().backward())
        got["failure"] = failing(rank)
        torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_torch(transformers=True)
class CheckedSplits(unittest.TestCase):
    def test_the_splits_stress_what_they_say(self):
        batch = row()
        parent = batch.parent.tolist()
        children = [parent.count(i) for i in range(len(parent))]
        self.assertEqual(len(parent), SPLITS["branch"][-1])
        b = SPLITS["branch"]
        self.assertGreater(children[b[1] - 1], 1)  # rank 1 starts below a branch point
        self.assertEqual((parent[b[2]], children[b[2] - 1]), (b[2] - 1, 1))  # rank 2 starts inside a segment
        self.assertTrue(any(0 <= p < b[1] for p in parent[b[2] :]))  # rank 2 hangs from rank 0
        t = SPLITS["three"]
        self.assertTrue(all(parent[i] == i - 1 and children[i - 1] == 1 for i in range(t[1] - 1, t[2] + 2)))  # one segment, 3 ranks
        self.assertLess(t[2] - t[1], 3)  # the kernel-4 window of rank 2's first node reaches rank 0

    def test_unsupported_mixers_are_refused_by_name(self):
        import transformers
        from treepack.torch.models import check_context_parallel as check_model

        torch.manual_seed(0)
        cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4, conv_kernel=4, expand=2)
        model = transformers.MambaForCausalLM(cfg)
        with self.assertRaisesRegex(TreepackError, r"layer 0 \(backbone.layers.0.mixer\): MambaMixer mixes tokens"):
            check_model(model)


@needs_torch(transformers=True)
class RecurrentLayersUnderContextParallelism(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ranks = spawned_ranks(worker, WORLD)
        cls.reference = {}
        for family in FAMILIES:
            model = hybrid_model(family)
            cls.reference[family] = {name: run(model, row(name)) for name in ("", "unscored")}

    def test_logprobs_loss_and_every_gradient_equal_the_one_rank_run(self):
        for family in FAMILIES:
            for name in list(SPLITS) + ["group"]:
                ref = self.reference[family]["unscored" if name == "unscored" else ""]
                worst = {"lp": 0.0, "loss": 0.0, "grad": 0.0}
                for got in [r["runs"][family, name] for r in self.ranks if (family, name) in r["runs"]]:
                    want = ref["lp"][got["lo"] : got["lo"] + got["lp"].shape[0]]
                    worst["lp"] = max(worst["lp"], float((torch.nan_to_num(got["lp"], 7.0) - torch.nan_to_num(want, 7.0)).abs().max()))
                    worst["loss"] = max(worst["loss"], abs(got["loss"] - ref["loss"]))
                    for n, g in got["grads"].items():
                        self.assertEqual(g is None, ref["grads"][n] is None, n)
                        if g is not None:
                            worst["grad"] = max(worst["grad"], float((g - ref["grads"][n]).abs().max()))
                scale = max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
                print(f"{family} {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + f" (largest gradient {scale:.1e})")
                self.assertGreater(scale, 1e-3)
                for k, v in worst.items():
                    self.assertLess(v, TOL, (family, name, k))
        self.assertEqual([r["runs"]["qwen3_5", "unscored"]["scored"] for r in self.ranks][1], 0)
        self.assertGreater(self.ranks[0]["runs"]["qwen3_5", "unscored"]["scored"], 0)

    def test_without_the_hand_overs_the_logprobs_differ(self):
        ref = self.reference["qwen3_5"][""]["lp"]
        for kind in ("state", "conv"):
            diff = 0.0
            for r in self.ranks:
                got = r["controls"][kind]
                diff = max(diff, float((got["lp"] - ref[got["lo"] : got["lo"] + got["lp"].shape[0]]).abs().max()))
            print(f"without the {kind} hand-over: logprobs differ by {diff:.1e}")
            self.assertGreater(diff, 1e4 * TOL, kind)  # the split runs above agree to ~1e-15

    def test_chunk_alignment_and_gradient_checkpointing_are_refused(self):
        for r in self.ranks:
            self.assertIn("chunk_align=True: under context parallelism", r["chunk_align"])
            self.assertIn("ran again in the same forward (gradient checkpointing?)", r["checkpointing"])

    def test_a_failed_rank_is_named_by_the_others(self):
        self.assertEqual(self.ranks[1]["failure"], "rank 1 failed on purpose")
        self.assertIn("context-parallel rank 2 of 3: layer 0 (Qwen3_5GatedDeltaNet)", self.ranks[2]["failure"])
        self.assertIn("with rank 1 failed", self.ranks[2]["failure"])


if __name__ == "__main__":
    unittest.main()
