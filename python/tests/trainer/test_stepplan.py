"""The step-plan executor (treepack.torch.stepplan): micro-batches that hang from a prefix cached by an earlier one
give, in float64, the loss, per-token logprobs and every parameter gradient of the unsplit forest run in one
piece (a float64 reference loss of the per-occurrence logprobs, summed over micro-batches as gradient accumulation
sums them). Plans here are written by hand (``plan_ops``, the stack discipline of docs/concepts/micro-batching.md) so each cut
is forced: at a branch point, inside a segment, at several depths, one prefix feeding many micro-batches.

Hybrid models (Gated DeltaNet, KDA, Mamba2 layers, test_hybrid's tiny configs with float64 casts) the same way, their
cached segments holding convolution tails and recurrent states; entropies, temperature and gradient checkpointing;
negative controls with the cached keys, states or tails zeroed; each convolution / chunked rule split at a cached
chain against its whole run (float64 here, bfloat16 through the CUDA kernels where a GPU is present)."""

from __future__ import annotations

import functools
import random
import unittest
from collections.abc import Sequence

import numpy as np
from support import needs_torch, tiny_model, torch, tpt, write_microbatch
from treepack import TreepackError
from treepack.pack import pack_sequences

VOCAB = 97


def plan_ops(chains: Sequence[tuple[int, ...]]) -> list[tuple[int, list[int], int]]:
    """(prefix_tokens, push ends, release) per micro-batch from each one's cached chain (token tuple), in run order:
    the stack is cut back to the common prefix of consecutive chains, and every pushed segment is split where a
    later cut will fall."""
    lcp = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: E731
    n = len(chains)
    down = [lcp(chains[m - 1], chains[m]) if m else 0 for m in range(n)] + [0]  # the stack's depth after the cut before m
    ops, starts = [], []  # starts: the stack's segments
    for m, c in enumerate(chains):
        ends = sorted({d for d in down[m + 1 :] if down[m] < d < len(c)} | ({len(c)} if len(c) > down[m] else set()))
        starts += [down[m]] + ends[:-1] if ends else []
        keep = [s for s in starts if s < down[m + 1]]
        ops.append((len(c), ends, len(starts) - len(keep)))
        starts = keep
    return ops


def occurrence_data(seqs: Sequence[Sequence[int]], seed: int) -> list[dict[str, np.ndarray]]:
    r = np.random.default_rng(seed)
    out = []
    for s in seqs:
        mask = (r.random(len(s)) < 0.8).astype(np.uint8)
        mask[0] = 0
        out.append(
            {
                "loss_mask": mask,
                "advantages": r.standard_normal(len(s)).astype(np.float32),
                "old_logprobs": (-r.random(len(s)) * 3).astype(np.float32),
            }
        )
    return out


def assemble(seqs, data, members: Sequence[int], meta=None):
    mb = pack_sequences([seqs[i] for i in members])
    for f in ("loss_mask", "advantages", "old_logprobs"):
        setattr(mb, f, np.concatenate([data[i][f] for i in members]))
    mb.meta["sequence_ids"] = [str(i) for i in members]
    mb.meta.update(meta or {})
    return tpt.from_microbatch(mb)


def loss_fn(lp, batch):
    """A float64 loss of the per-occurrence logprobs, nonlinear in them, summed over trainable occurrences."""
    occ = tpt.gather_occurrences(lp, batch)[batch.loss_mask]
    adv, old = batch.advantages[batch.loss_mask].double(), batch.old_logprobs[batch.loss_mask].double()
    return (adv * torch.exp(occ - old)).sum() + 0.1 * (occ**2).sum()


def per_sequence(lp, batch) -> dict[str, np.ndarray]:
    occ = tpt.gather_occurrences(lp, batch)
    out = {}
    for i, sid in enumerate(batch.meta["sequence_ids"]):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        m = batch.loss_mask[a:b]
        out[sid] = torch.where(m, occ[a:b], torch.zeros_like(occ[a:b])).numpy()
    return out


def sorted_groups(seqs, sizes) -> list[list[int]]:
    """Consecutive runs of the given sizes of the sequences in sorted (DFS) order."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    out, at = [], 0
    for s in sizes:
        out.append(order[at : at + s])
        at += s
    return out


def one_prefix_feeds_many(seed: int, vocab: int, stem_len: int):
    """Eight sequences behind one random stem of stem_len tokens and one sharing only its first 5, one micro-batch
    each: the stem, pushed once, feeds eight micro-batches. Returns (seqs, groups, hangs)."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(vocab) for _ in range(n)]  # noqa: E731
    stem = tok(stem_len)
    seqs = [stem + tok(r.randrange(2, 6)) for _ in range(8)] + [stem[:5] + tok(3)]
    groups = sorted_groups(seqs, [1] * len(seqs))
    return seqs, groups, [stem_len if seqs[g[0]][:stem_len] == stem else 5 for g in groups]


def chain_of(batch, h: int) -> tuple[int, ...]:
    return tuple(int(t) for t in batch.input_ids[:h])


class Checks:
    """The comparison of a planned execution with the unsplit forest (mixed into the test classes)."""

    def reference(self, model, seqs, data):
        model.zero_grad(set_to_none=True)
        batch = assemble(seqs, data, range(len(seqs)))
        lp = tpt.packed_logprobs(model, batch, attention="block").logprobs
        loss = loss_fn(lp, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return float(loss.detach()), per_sequence(lp.detach(), batch), grads

    def planned(self, model, seqs, data, groups, hangs, attention="block", block_size=4):
        batches = [assemble(seqs, data, g) for g in groups]
        ops = [tpt.StepOp(*o) for o in plan_ops([chain_of(b, h) for b, h in zip(batches, hangs)])]
        model.zero_grad(set_to_none=True)
        res = tpt.run_step_plan(model, batches, loss_fn, ops, attention=attention, block_size=block_size)
        per_seq = {}
        for b, lp in zip(batches, res.logprobs):
            per_seq.update(per_sequence(lp, b))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return float(sum(res.losses)), per_seq, grads, res

    def check(self, family, seqs, groups, hangs, attention="block", model=None, block_size=4):
        model = tiny_model(family, torch.float64, vocab=VOCAB) if model is None else model
        data = occurrence_data(seqs, seed=len(seqs))
        ref_loss, ref_lp, ref_grads = self.reference(model, seqs, data)
        loss, lp, grads, res = self.planned(model, seqs, data, groups, hangs, attention, block_size)
        self.assertAlmostEqual(loss, ref_loss, delta=1e-10 * max(1.0, abs(ref_loss)))
        self.assertEqual(sorted(lp), sorted(ref_lp))
        for sid in ref_lp:
            np.testing.assert_allclose(lp[sid], ref_lp[sid], atol=1e-10, rtol=0, err_msg=f"sequence {sid}")
        for n, g in ref_grads.items():
            self.assertTrue(
                torch.allclose(grads[n], g, atol=1e-10, rtol=0), f"{family} {n}: max diff {float((grads[n] - g).abs().max()):.3g}"
            )
        return res

    def check_entropy(self, model, seqs, groups, hangs, temperature=0.7):
        """``StepPlanRunner.forward`` / ``release`` as a trainer calls them (it back-propagates itself), with entropies
        (a loss term of them) and a temperature: per-token logprobs and entropies, the loss and every gradient of the
        unsplit forest's ``packed_logprobs(entropy=True, temperature=...)``."""
        data = occurrence_data(seqs, seed=len(seqs) + 1)

        def objective(lp, ent, batch):
            return loss_fn(lp, batch) + 0.05 * tpt.gather_occurrences(ent, batch)[batch.loss_mask].sum()

        model.zero_grad(set_to_none=True)
        whole = assemble(seqs, data, range(len(seqs)))
        ref = tpt.packed_logprobs(model, whole, attention="block", entropy=True, temperature=temperature)
        ref_loss = objective(ref.logprobs, ref.entropy, whole)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

        batches = [assemble(seqs, data, g) for g in groups]
        ops = [tpt.StepOp(*o) for o in plan_ops([chain_of(b, h) for b, h in zip(batches, hangs)])]
        model.zero_grad(set_to_none=True)
        runner = tpt.StepPlanRunner(model, attention="block", block_size=4, temperature=temperature, entropy=True)
        total, lp, ent = 0.0, {}, {}
        for b, op in zip(batches, ops):
            scores = runner.forward(b, op)
            loss = objective(scores.logprobs, scores.entropy, b)
            loss.backward()
            runner.release()
            total += float(loss.detach())
            lp.update(per_sequence(scores.logprobs.detach(), b))
            ent.update(per_sequence(scores.entropy.detach(), b))
        runner.finish()
        self.assertAlmostEqual(total, float(ref_loss.detach()), delta=1e-10 * max(1.0, abs(float(ref_loss.detach()))))
        for got, want in ((lp, per_sequence(ref.logprobs.detach(), whole)), (ent, per_sequence(ref.entropy.detach(), whole))):
            self.assertEqual(sorted(got), sorted(want))
            for sid in want:
                np.testing.assert_allclose(got[sid], want[sid], atol=1e-10, rtol=0, err_msg=f"sequence {sid}")
        for n, p in model.named_parameters():
            self.assertTrue(
                torch.allclose(p.grad, ref_grads[n], atol=1e-10, rtol=0), f"{n}: max diff {float((p.grad - ref_grads[n]).abs().max()):.3g}"
            )


@needs_torch(transformers=True)
class StepPlanTest(Checks, unittest.TestCase):
    def trunk(self, seed=0):
        r = random.Random(seed)
        tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
        stem = tok(12)
        mid_a, mid_b = stem + tok(5), stem + tok(6)
        seqs = [mid_a + tok(3), mid_a + tok(4), mid_a[:-2] + tok(3), mid_b + tok(2), mid_b + tok(5), stem[:7] + tok(4), tok(5)]
        return seqs

    def test_split_at_branch_points_and_inside_segments(self):
        seqs = self.trunk()
        for family in ("qwen3", "llama"):
            with self.subTest(family=family, cut="branch points"):
                # One micro-batch per sequence (sorted), each hanging from the prefix it shares with the previous one.
                groups = sorted_groups(seqs, [1] * len(seqs))
                hangs = []
                for m, g in enumerate(groups):
                    prev = seqs[groups[m - 1][0]] if m else []
                    cur = seqs[g[0]]
                    hangs.append(next((i for i, (x, y) in enumerate(zip(prev, cur)) if x != y), min(len(prev), len(cur))))
                res = self.check(family, seqs, groups, hangs)
                self.assertGreater(res.pushed_tokens, 0)
            with self.subTest(family=family, cut="branch points, one block per forest"):
                self.check(family, seqs, groups, hangs, block_size=128)
            with self.subTest(family=family, cut="inside a segment, several depths"):
                groups = sorted_groups(seqs, [2, 1, 2, 2])
                hangs = [0, 9, 4, 0]  # 9 and 4: inside the shared stem, not at a branch point
                self.check(family, seqs, groups, hangs)

    def test_one_prefix_feeds_many_micro_batches(self):
        seqs, groups, hangs = one_prefix_feeds_many(3, VOCAB, 20)
        for family in ("qwen3", "llama"):
            with self.subTest(family=family):
                res = self.check(family, seqs, groups, hangs)
                self.assertEqual(res.peak_cached_tokens, 20)
                self.assertEqual(res.pushed_tokens, 20)  # the stem, pushed once for all eight

    def test_empty_and_fully_cached_micro_batches(self):
        """A rank padded with an empty micro-batch, and one whose only sequence lies inside the cached chain."""
        r = random.Random(5)
        stem = [r.randrange(VOCAB) for _ in range(10)]
        seqs = [stem + [1, 2], stem[:6], stem + [3, 4, 5]]
        model = tiny_model("llama", torch.float64, vocab=VOCAB)
        data = occurrence_data(seqs, seed=6)
        ref_loss, ref_lp, ref_grads = self.reference(model, seqs, data)
        batches = [assemble(seqs, data, [1]), assemble(seqs, data, [0]), assemble(seqs, data, [2])]
        empty = tpt.from_microbatch(pack_sequences([]))
        ops = [tpt.StepOp(6, [6], 0), tpt.StepOp(10, [10], 0), tpt.StepOp(10, [], 2), tpt.StepOp(0, [], 0)]
        model.zero_grad(set_to_none=True)
        res = tpt.run_step_plan(model, batches + [empty], loss_fn, ops, attention="block")
        self.assertAlmostEqual(float(sum(res.losses)), ref_loss, delta=1e-10 * max(1.0, abs(ref_loss)))
        for n, p in model.named_parameters():
            self.assertTrue(torch.allclose(p.grad, ref_grads[n], atol=1e-10, rtol=0), n)

    def test_dense_mode_and_prefix_only_sequence(self):
        seqs = self.trunk(1)
        seqs.append(seqs[0][:10])  # a sequence that lies inside the cached chain
        groups = sorted_groups(seqs, [3, 3, 2])
        chains = [seqs[g[0]] for g in groups]
        hangs = [min(len(chains[0]), 10), 8, 0]
        self.check("qwen3", seqs, groups, hangs, attention="dense")

    def test_entropy_temperature_and_gradient_checkpointing(self):
        seqs = self.trunk()
        groups = sorted_groups(seqs, [2, 1, 2, 2])
        for family in ("qwen3", "llama"):
            with self.subTest(family=family, what="entropy"):
                self.check_entropy(tiny_model(family, torch.float64, vocab=VOCAB), seqs, groups, [0, 9, 4, 0])
        with self.subTest(what="gradient checkpointing"):
            # Checkpointed layers re-run in the backward, reading the cache without capturing anything twice.
            model = tiny_model("qwen3", torch.float64, vocab=VOCAB)
            model.gradient_checkpointing_enable()
            model.train()
            self.check("qwen3", seqs, groups, [0, 9, 4, 0], model=model)

    def test_packed_loss_per_micro_batch(self):
        """With packed_loss as each micro-batch's loss, the planned execution gives what
        running the same micro-batches in full gives (ordinary gradient accumulation over the plain split)."""
        seqs = self.trunk(3)
        model = tiny_model("qwen3", torch.float64, vocab=VOCAB)
        data = occurrence_data(seqs, seed=7)
        groups = sorted_groups(seqs, [2, 1, 2, 2])
        batches = [assemble(seqs, data, g) for g in groups]
        cfg = {"clip_low": 0.2, "clip_high": 0.28}
        packed = lambda lp, b: tpt.packed_loss(lp, b, cfg)[0]  # noqa: E731
        model.zero_grad(set_to_none=True)
        want = 0.0
        for b in batches:
            loss = packed(tpt.packed_logprobs(model, b, attention="block").logprobs, b)
            loss.backward()
            want += float(loss.detach())
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        ops = [tpt.StepOp(*o) for o in plan_ops([chain_of(b, h) for b, h in zip(batches, [0, 9, 4, 0])])]
        model.zero_grad(set_to_none=True)
        res = tpt.run_step_plan(model, batches, packed, ops, attention="block", block_size=4)
        self.assertAlmostEqual(float(sum(res.losses)), want, delta=1e-6 * max(1.0, abs(want)))
        for n, p in model.named_parameters():
            self.assertTrue(torch.allclose(p.grad, ref[n], atol=1e-6, rtol=1e-5), n)

    def test_sliding_window_and_sinks(self):
        """gpt-oss (a sliding-window layer of window 5 and a full one, attention sinks, MoE): windows are measured in
        positions, so a branch token's window reaches into the cached prefix."""
        from test_window import build

        model = build("gpt_oss", window=5)[0]
        seqs = self.trunk(2)
        self.check("gpt_oss", seqs, sorted_groups(seqs, [2, 1, 2, 2]), [0, 9, 4, 0], model=model)

    def test_without_the_cached_prefix_the_result_differs(self):
        """Negative control: the same planned micro-batches with the cached keys/values replaced by zeros (the branches
        no longer see their prefix) give another loss and other logprobs than the unsplit forest."""
        from treepack.torch import stepplan

        seqs = self.trunk()
        groups = sorted_groups(seqs, [2, 1, 2, 2])
        extend = stepplan._Prefix.extend

        def blind(self_, module, query, key, value):
            q, k, v = extend(self_, module, query, key, value)
            k, v = k.clone(), v.clone()
            k[:, :, : self_.rows] = 0
            v[:, :, : self_.rows] = 0
            return q, k, v

        stepplan._Prefix.extend = blind
        try:
            with self.assertRaises(AssertionError):
                self.check("qwen3", seqs, groups, [0, 9, 4, 0])
        finally:
            stepplan._Prefix.extend = extend

    def test_refusals(self):
        seqs = self.trunk()
        model = tiny_model("qwen3", torch.float64, vocab=VOCAB)
        data = occurrence_data(seqs, seed=2)
        b = assemble(seqs, data, sorted_groups(seqs, [2])[0])
        with self.assertRaises(TreepackError) as e:  # hangs from a prefix nobody pushed
            tpt.run_step_plan(model, [b], loss_fn, [tpt.StepOp(5, [], 0)])
        self.assertEqual(e.exception.field, "prefix_push")
        with self.assertRaises(TreepackError) as e:  # never released
            tpt.run_step_plan(model, [b], loss_fn, [tpt.StepOp(5, [5], 0)])
        self.assertEqual(e.exception.field, "prefix_release")
        sdpa = tiny_model("qwen3", torch.float64, attn="sdpa", vocab=VOCAB)
        with self.assertRaises(TreepackError) as e:
            tpt.run_step_plan(sdpa, [b], loss_fn)
        self.assertEqual(e.exception.field, "attn_implementation")
        model.model.noise = torch.nn.Dropout(0.1)
        model.train()
        with self.assertRaises(TreepackError) as e:
            tpt.run_step_plan(model, [b], loss_fn)
        self.assertEqual(e.exception.field, "dropout")
        model.eval()
        model.config.layer_types = ["full_attention", "linear_attention"]
        with self.assertRaises(TreepackError) as e:
            tpt.run_step_plan(model, [b], loss_fn)
        self.assertEqual(e.exception.field, "layer_types")

    def test_unsupported_token_mixers_are_refused_by_name(self):
        """A token mixer whose prefix state the executor does not carry (a short convolution) is refused before
        anything runs, naming the layer and its class."""
        import transformers

        cfg = transformers.Lfm2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            layer_types=["full_attention", "conv"],
            max_position_embeddings=128,
        )
        model = transformers.Lfm2ForCausalLM(cfg).double().eval()
        model.set_attn_implementation("treepack")
        seqs = self.trunk()
        b = assemble(seqs, occurrence_data(seqs, seed=8), sorted_groups(seqs, [2])[0])
        with self.assertRaises(TreepackError) as e:
            tpt.run_step_plan(model, [b], loss_fn)
        self.assertEqual(e.exception.field, "model")
        self.assertRegex(str(e.exception), r"layer 1 .*Lfm2ShortConv")

    def test_header_keys_load_and_check(self):
        import os
        import tempfile

        import treepack

        mb = pack_sequences([[5, 6, 7, 8], [5, 6, 7, 9, 1]])
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "mb.safetensors")
            write_microbatch(path, mb, {"prefix_tokens": "3", "prefix_push": "[1, 3]", "prefix_release": "2"})
            got = treepack.load(path)
            self.assertEqual((got.meta["prefix_tokens"], got.meta["prefix_push"], got.meta["prefix_release"]), (3, [1, 3], 2))
            self.assertEqual(tuple(tpt.step_op(tpt.load_microbatch(path)))[:3], (3, [1, 3], 2))
            for meta, field in (
                ({"prefix_tokens": "3"}, "prefix_tokens"),
                ({"prefix_tokens": "3", "prefix_push": "[3, 1]", "prefix_release": "0"}, "prefix_push"),
            ):
                write_microbatch(path, mb, meta)
                with self.assertRaises(TreepackError) as e:
                    treepack.load(path)
                self.assertEqual(e.exception.field, field)
            write_microbatch(path, mb, {"prefix_tokens": "5", "prefix_push": "[5]", "prefix_release": "0"})  # node 4 branches off
            self.assertTrue(any("prefix_tokens = 5" in p for p in treepack.check_invariants(treepack.load(path))))

    def test_ops_read_from_the_header(self):
        seqs = self.trunk()
        data = occurrence_data(seqs, seed=4)
        groups = sorted_groups(seqs, [3, 4])
        b0 = assemble(seqs, data, groups[0])
        b1 = assemble(seqs, data, groups[1])
        ops = plan_ops([chain_of(b0, 4), chain_of(b1, 4)])
        heads = [
            assemble(seqs, data, g, {"prefix_tokens": str(o[0]), "prefix_push": str(o[1]), "prefix_release": str(o[2])})
            for g, o in zip(groups, ops)
        ]
        self.assertEqual([tuple(tpt.step_op(b))[:3] for b in heads], [(o[0], list(o[1]), o[2]) for o in ops])


HYBRID_VOCAB = 61  # test_hybrid's tiny configs


def lcp(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def hybrid_forest(seed=0):
    """A 70-token stem (past the 64-token chunk grid) with branches at 2, 3, 30, 63, 64, 66, a sequence ending inside
    it (40) and an unrelated tree."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(HYBRID_VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(70)
    seqs = [stem[:p] + tok(r.randrange(2, 6)) for p in (2, 3, 30, 63, 64, 66)]
    return seqs + [stem + tok(4), stem + tok(3), stem[:40], tok(6)]


def one_per_sequence(seqs):
    """Sorted, one micro-batch per sequence hanging at its common prefix with the previous one: cuts at every branch
    point, cached segments of 1 token (cuts at 2, 3), a stack several segments deep."""
    groups = sorted_groups(seqs, [1] * len(seqs))
    hangs = [lcp(seqs[groups[m - 1][0]], seqs[g[0]]) if m else 0 for m, g in enumerate(groups)]
    return groups, hangs


@needs_torch(transformers=True)
class DataParallelStepPlanTest(unittest.TestCase):
    def test_two_gloo_ranks_equal_the_unsplit_forest_and_plain_ddp(self):
        """Two processes (gloo, CPU), each running its own planned micro-batches on a DistributedDataParallel model
        (``run_step_plan(ddp, ...)``: no backward synchronises, one all-reduce after the rank's last pop): every
        gradient equals the unsplit forest's divided by the world size, and plain DDP's on the same micro-batches run
        in full; a rank with only an empty micro-batch takes part with zeros. Without the all-reduce a rank holds
        only its own part (the control). Workers: ddp_stepplan.py."""
        import json
        import os
        import tempfile

        import ddp_stepplan
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            mp.spawn(ddp_stepplan.worker, args=(2, out), nprocs=2, join=True)
            reports = []
            for r in range(2):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    reports.append(json.load(f))
        for rank, report in enumerate(reports):
            for name, got in report.items():
                with self.subTest(rank=rank, scenario=name):
                    self.assertLess(got["unsplit_diff"], 1e-10)
                    if got["plain_ddp_diff"] is not None:
                        self.assertLess(got["plain_ddp_diff"], 1e-10)
                    self.assertGreater(got["unsynced_diff"], 1e-3 * got["grad_scale"])
        self.assertGreater(reports[0]["split"]["pushed_tokens"], 0)
        self.assertGreater(reports[1]["split"]["pushed_tokens"], 0)
        self.assertIsNotNone(reports[1]["split"]["plain_ddp_diff"])

    def test_sharded_wrappers_are_refused(self):
        """FSDP's and DeepSpeed's forward gathers sharded parameters, which the executor's own layer calls bypass."""
        model = tiny_model("qwen3", torch.float64, vocab=VOCAB)

        class DeepSpeedEngine(torch.nn.Module):
            def __init__(self, module):
                super().__init__()
                self.module = module

        with self.assertRaises(TreepackError) as e:
            tpt.StepPlanRunner(DeepSpeedEngine(model))
        self.assertEqual(e.exception.field, "model")
        self.assertIn("DeepSpeedEngine", str(e.exception))


@needs_torch(transformers=True)
class HybridStepPlanTest(Checks, unittest.TestCase):
    """Recurrent layers in the step plan: a cached segment holds each recurrent layer's last K-1 convolution inputs
    and its final state; branches start from them and their gradients flow back through the pops. Tiny float64 hybrids
    of test_hybrid (float64 casts throughout), against the unsplit forest run packed in one piece; the forest crosses
    the 64-token chunk grid, and cuts 1 token apart make cached segments shorter than the convolution kernel."""

    FAMILIES = ("qwen3_5", "nemotron_h")  # Gated DeltaNet + attention, Mamba2 + attention (+ MLP layers)

    def model(self, family):
        from test_hybrid import hybrid_model

        return hybrid_model(family)

    def test_split_at_branch_points_inside_segments_and_at_several_depths(self):
        seqs = hybrid_forest()
        groups, hangs = one_per_sequence(seqs)
        self.assertGreaterEqual(sum(1 for h in hangs if h), 6)
        for family in self.FAMILIES:
            model = self.model(family)
            with self.subTest(family=family, cut="branch points"):
                res = self.check(family, seqs, groups, hangs, model=model)
                self.assertGreater(res.pushed_tokens, 0)
                self.assertGreaterEqual(res.peak_cached_tokens, 66)
            with self.subTest(family=family, cut="inside segments"):
                # Pairs of sorted sequences hanging below their common prefix (0, 3, 40, 63, 66), off every branch point:
                # 1 inside [0, 2), 35 inside [30, 40), 50 inside [40, 63), 65 inside [64, 66).
                pairs = sorted_groups(seqs, [2] * 5)
                inside = [0, 1, 35, 50, 65]
                common = [min(lcp(seqs[g[0]], seqs[i]) for i in g) for g in pairs]
                self.assertTrue(all(h < c or h == c == 0 for h, c in zip(inside, common)), common)
                self.check(family, seqs, pairs, inside, model=model)

    def test_one_prefix_feeds_many_micro_batches(self):
        seqs, groups, hangs = one_prefix_feeds_many(4, HYBRID_VOCAB, 67)
        for family in self.FAMILIES:
            with self.subTest(family=family):
                res = self.check(family, seqs, groups, hangs, model=self.model(family))
                self.assertEqual(res.peak_cached_tokens, 67)
                self.assertEqual(res.pushed_tokens, 67)  # the stem, pushed once for all eight

    def test_every_family(self):
        """The other families whose recurrent layers the executor carries, through the same cuts: Qwen3-Next,
        OLMo-Hybrid, Qwen3.5-MoE (Gated DeltaNet), Kimi Linear (KDA, MLA attention), Bamba, Granite-4 hybrid,
        Falcon-H1 (attention and Mamba2 in one layer), Zamba2 (a shared attention block) (Mamba2)."""
        seqs = hybrid_forest(1)
        groups, hangs = one_per_sequence(seqs)
        for family in ("qwen3_next", "olmo_hybrid", "qwen3_5_moe", "kimi_linear", "bamba", "granitemoehybrid", "falcon_h1", "zamba2"):
            with self.subTest(family=family):
                self.check(family, seqs, groups, hangs, model=self.model(family))

    def test_entropy_and_gradient_checkpointing(self):
        seqs = hybrid_forest()
        groups, hangs = one_per_sequence(seqs)
        for family in self.FAMILIES:
            with self.subTest(family=family, what="entropy"):
                self.check_entropy(self.model(family), seqs, groups, hangs)
            with self.subTest(family=family, what="gradient checkpointing"):
                model = self.model(family)
                model.gradient_checkpointing_enable()
                model.train()
                self.check(family, seqs, groups, hangs, model=model)

    def test_without_the_cached_state_the_result_differs(self):
        """Negative control: the same plan with each recurrent layer's cached state and convolution inputs replaced by
        zeros (the attention still reads its cached keys) differs from the unsplit forest."""
        from treepack.torch import stepplan

        seqs = hybrid_forest()
        groups, hangs = one_per_sequence(seqs)
        state, tail = stepplan._Prefix.state, stepplan._Prefix.tail
        for blind in ("state", "tail"):
            for family in self.FAMILIES:
                with self.subTest(family=family, zeroed=blind):
                    if blind == "state":
                        stepplan._Prefix.state = lambda self_, key: torch.zeros_like(state(self_, key))
                    else:
                        stepplan._Prefix.tail = lambda self_, key, t: torch.zeros_like(tail(self_, key, t))
                    try:
                        with self.assertRaises(AssertionError):
                            self.check(family, seqs, groups, hangs, model=self.model(family))
                    finally:
                        stepplan._Prefix.state, stepplan._Prefix.tail = state, tail

    def test_refusals(self):
        seqs = hybrid_forest()
        model = self.model("qwen3_5")
        data = occurrence_data(seqs, seed=3)
        groups = sorted_groups(seqs, [3, 2, 3, 2])
        b = assemble(seqs, data, groups[1])
        with self.assertRaises(TreepackError) as e:  # its second sequence branches off above the cached chain's end
            c = lcp(seqs[groups[1][0]], seqs[groups[1][1]])
            tpt.run_step_plan(model, [b], loss_fn, [tpt.StepOp(c + 1, [c + 1], 1)])
        self.assertEqual(e.exception.field, "prefix_tokens")
        tpt.prepare(model, chunk_align=True)
        with self.assertRaises(TreepackError) as e:
            tpt.run_step_plan(model, [b], loss_fn)
        self.assertEqual(e.exception.field, "chunk_align")


class FakePrefix:
    """The prefix protocol recurrent.py reads (docs/concepts/micro-batching.md): ``rows`` cached nodes, their convolution inputs
    and state per call key as given; what the layer hands back is ``kept``."""

    def __init__(self, rows, cache=None):
        self.rows, self.cache, self.kept = rows, cache or {}, {}

    def tail(self, key, t):
        return self.cache[key][:, :, -t:]

    def state(self, key):
        return self.cache[key]

    def keep(self, key, tensor):
        self.kept[key] = tensor


def split_rule_diffs(device, dtype, float64=False):
    """(function, max |split - whole| / max(|whole|, 1) over outputs and input gradients, the same with the
    handed-over state or convolution tail zeroed) for the convolution and chunked rules transformers binds now (the pure-torch
    references, or FLA / causal-conv1d / mamba-ssm where installed), on random per-node inputs: a forest run whole,
    and run as its first 70 nodes (a chain) then the rest hanging from them, the chain's kept state and tail handed
    over without detaching (so the rest's gradient reaches the chain through them: the kernels' dht). ``float64``:
    the modeling modules with their float32 casts made float64 (test_hybrid.float64_modeling)."""
    import importlib

    from test_hybrid import float64_modeling

    qwen, kimi, nemo = (
        float64_modeling(n) if float64 else importlib.import_module(f"transformers.models.{n}.modeling_{n}")
        for n in ("qwen3_5", "kimi_linear", "nemotron_h")
    )

    from treepack.torch import recurrent

    r = random.Random(7)
    stem = [0] + [r.randrange(1, 50) for _ in range(69)]  # sorts before the unrelated root, so nodes [0, 70) are the stem
    seqs = [stem + [r.randrange(50) for _ in range(n)] for n in (3, 5, 1)] + [[60, 1, 2, 3, 4, 5]]
    batch = tpt.from_microbatch(pack_sequences(seqs)).to(device)
    h, N = 70, batch.num_nodes
    assert torch.equal(batch.parent[:h].cpu(), torch.arange(h) - 1) and set(batch.parent[h:].tolist()) & set(range(h)) <= {h - 1}
    chain = tpt.from_microbatch(pack_sequences([stem])).to(device)
    H, D = 2, 8
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(shape, generator=g).to(device, dtype)  # noqa: E731
    beta, decay = torch.sigmoid(rnd(1, N, H)), -torch.rand((1, N, H), generator=g).to(device, dtype) * 0.1  # slow decay: the state matters
    dt, A, w = rnd(1, N, H), -torch.rand(H, generator=g).to(device), rnd(3 * D, 4)
    ones = torch.ones(H, device=device)
    cases = {  # name: (function, how the layer calls it on node inputs, tree way, node dimension, inputs [1, N, ...] or [1, C, N])
        "causal_conv1d_fn": (qwen.causal_conv1d_fn, lambda f, x: f(x, w, activation="silu"), recurrent.tree_conv, 2, [rnd(1, 3 * D, N)]),
        "torch_chunk_gated_delta_rule": (
            qwen.torch_chunk_gated_delta_rule,
            lambda f, q, k, v, gg, bb: f(q, k, v, g=gg, beta=bb, use_qk_l2norm_in_kernel=True)[0],
            recurrent.tree_chunk_rule,
            1,
            [rnd(1, N, H, D), rnd(1, N, H, D), rnd(1, N, H, D), decay, beta],
        ),
        "chunk_kimi_delta_attention": (
            kimi.chunk_kimi_delta_attention,
            lambda f, q, k, v, gg, bb: f(q, k, v, g=gg[..., None].expand(q.shape), beta=bb, use_qk_l2norm_in_kernel=True)[0],
            recurrent.tree_chunk_rule,
            1,
            [rnd(1, N, H, D), rnd(1, N, H, D), rnd(1, N, H, D), decay, beta],
        ),
        "mamba2_chunk_scan": (
            nemo.mamba2_chunk_scan,
            lambda f, x, d, b, c: f(x, d, A, b, c, chunk_size=64, D=ones, dt_bias=ones, dt_softplus=True, dt_limit=(1e-3, float("inf"))),
            recurrent.tree_mamba2_scan,
            1,
            [rnd(1, N, H, D), dt, rnd(1, N, 1, D), rnd(1, N, 1, D)],
        ),
    }

    def check(name, fn, apply, kind, dim, inputs):
        """The case's largest relative differences from the whole-forest run: the split run, the split run with its
        cache zeroed (which must differ)."""

        def run(mask, prefix, xs):
            mask.prefix = prefix
            tree = recurrent.Tree(mask, False, name)
            return apply(functools.partial(kind, fn, tree), *xs)

        leaves = [x.detach().requires_grad_() for x in inputs]
        whole = run(tpt.tree_mask(batch), None, leaves)
        weight = torch.randn(whole.shape, generator=g).to(device, dtype)
        want = [whole] + list(torch.autograd.grad((whole * weight).sum(), leaves))

        def split(blind):
            top = FakePrefix(0)
            head = run(tpt.tree_mask(chain), top, [x.narrow(dim, 0, h) for x in leaves])
            cache = {k: torch.zeros_like(v) if blind else v for k, v in top.kept.items()}
            rest = run(tpt.tree_mask(batch), FakePrefix(h, cache), [x.narrow(dim, h, N - h) for x in leaves])
            out = torch.cat([head, rest], dim)
            return [out] + list(torch.autograd.grad((out * weight).sum(), leaves))

        diff = lambda got: max(float((a - b).detach().abs().max() / max(float(b.detach().abs().max()), 1.0)) for a, b in zip(got, want))  # noqa: E731
        return diff(split(False)), diff(split(True))

    for name, case in cases.items():
        yield (name, *check(name, *case))


@needs_torch(transformers=True)
class SplitRules(unittest.TestCase):
    def test_state_and_tail_handed_over_equal_the_whole_run(self):
        """float64: a recurrent call split at a cached chain equals the whole run (outputs and input gradients), and
        differs with the handed-over state / tail zeroed."""
        for name, d, blind in split_rule_diffs(torch.device("cpu"), torch.float64, float64=True):
            with self.subTest(fn=name):
                self.assertLess(d, 1e-10)
                self.assertGreater(blind, 1e-2)


@needs_torch(transformers=True, cuda="the CUDA kernels transformers binds (FLA, causal-conv1d, mamba-ssm) need a CUDA device")
class SplitRulesCuda(unittest.TestCase):
    def test_cuda_kernels_take_the_state_and_its_gradient(self):
        """bfloat16 (FLA refuses float32), whatever transformers binds on this host: the split run equals the whole
        one up to bfloat16 rounding (initial_state in, the final state's gradient back), where zeroing the handed-over
        state or tail differs by O(1)."""
        for name, d, blind in split_rule_diffs(torch.device("cuda"), torch.bfloat16):
            with self.subTest(fn=name):
                print(f"\nCUDA bfloat16 {name} split at a cached chain: max diff {d:.3g}, state / tail zeroed {blind:.3g}")
                self.assertLess(d, 5e-2)
                self.assertGreater(blind, 10 * max(d, 1e-2))


if __name__ == "__main__":
    unittest.main()
