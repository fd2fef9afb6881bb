"""Recurrent layers under context parallelism (python/treepack/torch/cp_recurrent.py): three gloo processes (spawned,
not forked) each run their range of one packed row through tiny float64 Qwen3.5 (Gated DeltaNet), Nemotron-H
(Mamba2) and Kimi Linear (KDA) models of the real transformers classes, whose only token mixers are recurrent
layers; the hidden states, a loss over them and every parameter gradient (summed over the ranks) equal the one-rank
tree run's within 1e-10. The splits put a rank boundary inside a segment, at a branch point, under a branch point two
ranks back, and across a segment spanning three ranks whose middle rank holds fewer tokens than the convolution's
window; one split runs in a sub-group whose ranks are not the world's. Negative controls: without the state
hand-over, or without the convolution windows' hand-over, the hidden states differ. A rank that fails: the others
raise a TreepackError naming it within the group's timeout, no hang; bad bounds and chunk alignment are refused."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import tempfile
import types
import unittest

from support import needs_torch, pack, torch, tpt
from test_hybrid import VOCAB, float64_modeling
from treepack import TreepackError

WORLD = 3
HIDDEN = 32
# Splits of the forest below (N = 38) over the ranks, and what each stresses (checked in CheckedSplits).
SPLITS = {
    "branch": [0, 13, 28, 38],  # 13 starts under branch point 12; 28 continues 27's segment; 29 hangs from 12 on rank 0
    "three": [0, 15, 17, 38],  # segment 13..18 spans all three ranks; rank 1 holds 2 < K - 1 tokens
}
GROUP_SPLIT = [0, 20, 38]  # over the sub-group of world ranks 1 and 2
FAMILIES = ("qwen3_5", "nemotron_h", "kimi_linear")


def forest() -> list[list[int]]:
    r = random.Random(0)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(12)
    return [stem + tok(5), stem[:6] + tok(9), stem[:6] + tok(2), stem + tok(3), tok(4), stem[:1] + tok(3)]


def recurrent_model(family: str):
    """A tiny float64 model of the family whose token mixers are all recurrent (conv kernel 4), prepared."""
    import transformers

    att = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    lin = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "qwen3_5":
        cls, cfg = "Qwen3_5ForCausalLM", transformers.Qwen3_5TextConfig(num_hidden_layers=2, layer_types=["linear_attention"] * 2, **lin, **att)
    elif family == "nemotron_h":
        cls, cfg = "NemotronHForCausalLM", transformers.NemotronHConfig(
            layers_block_type=["mamba", "mlp", "mamba"], mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, **att
        )
    else:
        cls, cfg = "KimiLinearForCausalLM", transformers.KimiLinearConfig(
            vocab_size=VOCAB,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            hidden_size=HIDDEN,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            mlp_layer_types=["dense", "dense"],
            max_position_embeddings=512,
            linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "full_attn_layers": [], "kda_layers": [1, 2]},
        )
    torch.manual_seed(0)
    model = getattr(float64_modeling(family), cls)(cfg).to(torch.float64).eval()
    model.set_attn_implementation("treepack")
    return tpt.prepare(model)


def weights(n: int):
    """The loss's fixed weights per node and hidden unit: loss = sum(hidden * weights)."""
    return torch.randn(n, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def hidden(model, batch, mask, lo: int, hi: int):
    out = model.model(input_ids=batch.input_ids[lo:hi][None].long(), position_ids=batch.position_ids[lo:hi][None].long(), attention_mask=mask)
    return out.last_hidden_state[0]


def cp_mask(batch, group, rank: int, bounds: list[int]):
    mask = tpt.tree_mask(batch)
    mask.context_parallel = types.SimpleNamespace(group=group, rank=rank, size=len(bounds) - 1, bounds=bounds)
    return mask


def split_run(model, batch, group, rank: int, bounds: list[int], grad: bool = True):
    """This rank's part of the split run: (all ranks' hidden states [N, D], the parameter gradients summed over the
    group)."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    lo, hi = bounds[rank], bounds[rank + 1]
    with torch.set_grad_enabled(grad):
        h = hidden(model, batch, cp_mask(batch, group, rank, bounds), lo, hi)
        if grad:
            (h * weights(batch.num_nodes)[lo:hi]).sum().backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    parts = [None] * (len(bounds) - 1)
    dist.all_gather_object(parts, h.detach(), group=group)
    return torch.cat(parts), {n: p.grad for n, p in model.named_parameters()}


def without(kind: str):
    """The negative controls' plans: no state hand-over (hanging roots start from zeros) or no window hand-over
    (windows read zeros where they reach an earlier rank); every rank drops its messages alike."""
    from treepack.torch import cp_recurrent

    if kind == "state":
        orig = cp_recurrent.state_plan
        return "state_plan", lambda *a: dataclasses.replace(orig(*a), recv=[], send=[])
    orig_conv = cp_recurrent.conv_plan

    def conv_plan(*a):
        p = orig_conv(*a)
        w = torch.where(p.windows < p.imports, -1, p.windows - p.imports)
        return dataclasses.replace(p, recv=[], send=[], imports=0, windows=w)

    return "conv_plan", conv_plan


def failing(rank: int, out: str) -> dict:
    """Rank 1 fails before its forward; ranks 0 and 2 must raise, naming it, within the group's 5 s timeout."""
    import torch.distributed as dist

    group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=5))
    model = recurrent_model("qwen3_5")
    batch = tpt.load_microbatch(pack(forest()))
    if rank == 1:
        return {"failed": "rank 1 failed on purpose"}
    try:
        with torch.no_grad():
            hidden(model, batch, cp_mask(batch, group, rank, SPLITS["branch"]), SPLITS["branch"][rank], SPLITS["branch"][rank + 1])
        return {"error": ""}
    except TreepackError as e:
        return {"error": str(e)}


def worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        from treepack.torch import cp_recurrent

        batch = tpt.load_microbatch(pack(forest()))
        sub = dist.new_group([1, 2])
        got: dict = {"runs": {}, "controls": {}, "refused": {}}
        for family in FAMILIES:
            model = recurrent_model(family)
            for name, bounds in SPLITS.items():
                got["runs"][family, name] = split_run(model, batch, None, rank, bounds)
            if rank > 0:
                got["runs"][family, "group"] = split_run(model, batch, sub, rank - 1, GROUP_SPLIT)
        model = recurrent_model("qwen3_5")
        for kind in ("state", "conv"):
            name, fn = without(kind)
            orig = getattr(cp_recurrent, name)
            setattr(cp_recurrent, name, fn)
            try:
                got["controls"][kind] = split_run(model, batch, None, rank, SPLITS["three"], grad=False)[0]
            finally:
                setattr(cp_recurrent, name, orig)
        for what, call in (
            ("bounds", lambda: hidden(model, batch, cp_mask(batch, None, rank, [0, 13, 40, 38]), 0, 13)),
            ("length", lambda: hidden(model, batch, cp_mask(batch, None, rank, SPLITS["branch"]), 0, 5)),
            ("chunk_align", lambda: hidden(tpt.prepare(recurrent_model("qwen3_5"), chunk_align=True), batch, cp_mask(batch, None, rank, SPLITS["branch"]), SPLITS["branch"][rank], SPLITS["branch"][rank + 1])),
        ):
            try:
                with torch.no_grad():
                    call()
                got["refused"][what] = ""
            except TreepackError as e:
                got["refused"][what] = str(e)
        got["failure"] = failing(rank, out)
        torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_torch(transformers=True)
class CheckedSplits(unittest.TestCase):
    def test_the_splits_stress_what_they_say(self):
        batch = tpt.load_microbatch(pack(forest()))
        parent = batch.parent.tolist()
        children = [parent.count(i) for i in range(len(parent))]
        self.assertEqual(len(parent), SPLITS["branch"][-1])
        b = SPLITS["branch"]
        self.assertGreater(children[b[1] - 1], 1)  # rank 1 starts below a branch point
        self.assertEqual((parent[b[2]], children[b[2] - 1]), (b[2] - 1, 1))  # rank 2 starts inside a segment
        self.assertTrue(any(p >= 0 and p < b[1] for p in parent[b[2] :]))  # rank 2 hangs from rank 0
        t = SPLITS["three"]
        self.assertTrue(all(parent[i] == i - 1 and children[i - 1] == 1 for i in range(t[1] - 1, t[2] + 2)))  # one segment, 3 ranks
        self.assertLess(t[2] - t[1], 3)  # the kernel-4 window of rank 2's first node reaches rank 0


@needs_torch(transformers=True)
class RecurrentLayersUnderContextParallelism(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(worker, args=(out,), nprocs=WORLD, join=True, start_method="spawn")
            cls.ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
        batch = tpt.load_microbatch(pack(forest()))
        cls.reference = {}
        for family in FAMILIES:
            model = recurrent_model(family)
            h = hidden(model, batch, tpt.tree_mask(batch), 0, batch.num_nodes)
            (h * weights(batch.num_nodes)).sum().backward()
            cls.reference[family] = h.detach(), {n: p.grad for n, p in model.named_parameters()}

    def test_hidden_states_and_every_gradient_equal_the_one_rank_run(self):
        for family in FAMILIES:
            ref_h, ref_g = self.reference[family]
            for name in list(SPLITS) + ["group"]:
                h, grads = self.ranks[1]["runs"][family, name]
                worst = max(float((g - ref_g[n]).abs().max()) for n, g in grads.items() if g is not None)
                print(f"{family} {name}: hidden {float((h - ref_h).abs().max()):.1e}, gradients {worst:.1e}")
                self.assertLess(float((h - ref_h).abs().max()), 1e-10, (family, name))
                self.assertEqual({n for n, g in grads.items() if g is None}, {n for n, g in ref_g.items() if g is None})
                self.assertLess(worst, 1e-10, (family, name))

    def test_without_the_hand_overs_the_results_differ(self):
        ref_h = self.reference["qwen3_5"][0]
        for kind, h in self.ranks[0]["controls"].items():
            diff = float((h - ref_h).abs().max())
            print(f"without the {kind} hand-over: hidden differs by {diff:.1e}")
            self.assertGreater(diff, 1e-3, kind)

    def test_refusals(self):
        for r in range(WORLD):
            refused = self.ranks[r]["refused"]
            self.assertIn("expected 4 non-decreasing bounds", refused["bounds"])
            self.assertIn(f"rank {r} of a context-parallel group runs nodes", refused["length"])
            self.assertIn("chunk_align=True", refused["chunk_align"])

    def test_a_failed_rank_is_named_by_the_others(self):
        self.assertEqual(self.ranks[1]["failure"], {"failed": "rank 1 failed on purpose"})
        self.assertIn("with rank 1 failed (did rank 1 fail or time out?)", self.ranks[2]["failure"]["error"])


if __name__ == "__main__":
    unittest.main()
