"""The torch loss (treepack.torch.packed_loss) against its oracles, in float64.

The C core (tp_loss) reads float32 lp and per-occurrence floats and computes in double, so every value fed here is
float32-representable: then loss and metrics must agree to 1e-12 relative (only the summation order differs). The core
returns its gradient rounded to float32, so against it the gradient's honest bound is that rounding (half a float32
ulp, 2^-24 relative); the gradient is also held to 1e-12 against plain_loss (test_packed_loss.py), an independent
per-occurrence float64 formula. Every option on every shape: the forests of support.forests (duplicates, prefixes, so
nodes sum several occurrences), an empty batch, one token, sequences with no trainable token, log ratios at the clamp's
ends, NaN at masked positions.
Compiled (fullgraph) equals eager; meta tensors prove the hot path reads no value on the host. The CUDA library's
kernels (tp_cuda_loss_host, an emulated build included; tp_cuda_loss on a GPU) are held to the same bounds where
they load (TREEPACK_REQUIRE_CUDA=1 fails instead of skipping)."""

import itertools
import json
import os
import random
import unittest

from support import FIXTURE, forests, needs_torch, pack, torch, tpt
from test_packed_loss import fixture_batch, fixture_configs, plain_loss
from treepack import TreepackError, pack_sequences
from treepack.loss import cuda_library

if tpt is not None:
    from treepack.torch.loss_kernels import kernel_loss

F32_HALF_ULP = 2.0**-24
FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
POLICIES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-turn-mean-token-mean")
KLS = ("none", "k1", "abs", "k2", "k3")
TIS = ("none", "token", "sequence")


def every_config():
    """Each policy x aggregation x kl x tis once (225), the numeric options cycling through the values the suites use
    (asymmetric clip, dual clip, a clamp that binds, global counts, loss_scale 0, tis caps that bind)."""
    extras = itertools.cycle(
        [
            {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
            {"clip_low": 0.1, "clip_high": 1.0, "log_ratio_clamp": 0.3, "loss_scale": 8.0},
            {"clip_low": 0.0, "global_tokens": 1000.0, "global_sequences": 50.0, "tis_cap": 0.5},
            {"clip_low": 0.2, "dual_clip": 2.5, "loss_scale": 0.0, "tis_cap": 1.5},
            {"clip_low": 0.2, "clip_high": 0.28, "log_ratio_clamp": 1.0, "global_sequences": 40.0},
        ]
    )
    for (policy, agg, kl, tis), extra in zip(itertools.product(POLICIES, AGGREGATIONS, KLS, TIS), extras):
        cfg = {"policy": policy, "aggregation": agg, "kl": kl, "tis": tis, "norm_constant": 7.5, "kl_coef": 0.5 * (kl != "none"), **extra}
        if policy != "ppo":
            cfg.pop("dual_clip", None)
        yield cfg


def with_turns(batch, seed):
    """turn_ids [M]: each sequence's occurrences cut into runs of random lengths, numbered in order."""
    r = random.Random(seed)
    off = batch["seq_offsets"].tolist()
    ids = []
    for i in range(len(off) - 1):
        t = r.randrange(3)
        for _ in range(off[i], off[i + 1]):
            t += r.random() < 0.3
            ids.append(t)
    return {**batch, "turn_ids": torch.tensor(ids, dtype=torch.int64)}


def as_batch(mb, seed, weights=False):
    """A packed micro-batch as the loss's mapping, with turn ids, NaN at masked positions of every field, A = 0 and
    lp = old (ratio exactly 1) at some trainable occurrences; lp [N] float64 holding float32 values."""
    g = torch.Generator().manual_seed(seed)
    b = {k: torch.as_tensor(getattr(mb, k)) for k in ("seq_offsets", "seq_positions", "loss_mask") + FIELDS}
    b["seq_offsets"], b["seq_positions"], b["loss_mask"] = b["seq_offsets"].long(), b["seq_positions"].long(), b["loss_mask"].bool()
    M, N = len(b["seq_positions"]), len(mb.input_ids)
    m = b["loss_mask"]
    for f in FIELDS:
        b[f] = torch.where(m, b[f], torch.tensor(float("nan")))
    b["advantages"][torch.rand(M, generator=g) < 0.1] = 0.0
    lp = (-torch.rand(N, generator=g, dtype=torch.float64) * 3).float().double()
    lp[~torch.isin(torch.arange(N), b["seq_positions"][m])] = float("nan")
    ones = (torch.rand(M, generator=g) < 0.15) & m
    lp[b["seq_positions"][ones]] = b["old_logprobs"][ones].double()  # ratio 1 (where a node's occurrences disagree, the last wins)
    if weights:
        S = len(b["seq_offsets"]) - 1
        b["seq_weight"] = torch.tensor([(0.0, 1.0, 0.25, 3.0)[i % 4] for i in range(S)])
    return with_turns(b, seed), lp


def shapes():
    """(name, batch, lp): every forest of support.forests, then the adversarial batches."""
    out = []
    for seed in range(2):
        for shape, seqs in forests(31, seed).items():
            out.append((f"{shape}/{seed}", *as_batch(pack(seqs, pad=seed, seed=seed), seed, weights=seed == 1)))
    empty = {
        "seq_offsets": torch.zeros(1, dtype=torch.int64),
        "seq_positions": torch.zeros(0, dtype=torch.int64),
        "loss_mask": torch.zeros(0, dtype=torch.bool),
        "turn_ids": torch.zeros(0, dtype=torch.int64),
        **{f: torch.zeros(0) for f in FIELDS},
    }
    out.append(("empty", empty, torch.zeros(0, dtype=torch.float64)))
    out.append(("empty sequences", {**empty, "seq_offsets": torch.zeros(3, dtype=torch.int64)}, torch.zeros(2, dtype=torch.float64)))
    one = {
        "seq_offsets": torch.tensor([0, 1]),
        "seq_positions": torch.tensor([0]),
        "loss_mask": torch.tensor([True]),
        "turn_ids": torch.tensor([4]),
        "advantages": torch.tensor([-1.5]),
        "old_logprobs": torch.tensor([-0.75]),
        "ref_logprobs": torch.tensor([-2.0]),
        "rollout_logprobs": torch.tensor([-0.5]),
    }
    out.append(("one token", one, torch.tensor([-0.25], dtype=torch.float64)))
    b, lp = as_batch(pack([[1, 2, 3], [1, 2, 3], [1, 2], [4, 5, 6, 7]], seed=3), 3)
    off = b["seq_offsets"].tolist()
    b["loss_mask"] = b["loss_mask"].clone()
    b["loss_mask"][off[1] : off[2]] = False  # sequences with no trainable token
    b["loss_mask"][off[3] :] = False
    out.append(("untrainable sequences", b, lp))
    # Log ratios of exactly ±1 (the clamp of one config in five): the kernels pass the derivative at the clamp's ends.
    lp = torch.tensor([-0.5, -1.5, -0.25, -2.0, -1.0], dtype=torch.float64)
    edge = {
        "seq_offsets": torch.tensor([0, 2, 5]),
        "seq_positions": torch.arange(5),
        "loss_mask": torch.ones(5, dtype=torch.bool),
        "turn_ids": torch.tensor([0, 1, 0, 0, 1]),
        "advantages": torch.tensor([-1.0, 1.0, -2.0, 0.5, 1.5]),
        "old_logprobs": torch.tensor([-1.5, -0.5, -1.25, -1.0, -1.0]),
        "ref_logprobs": torch.tensor([-0.75, -1.5, -0.5, -2.5, -1.0]),
        "rollout_logprobs": torch.tensor([-1.0, -0.5, -2.25, -1.0, -0.5]),
    }
    out.append(("clamp ends", edge, lp))
    return out


def run_torch(lp, batch, cfg):
    x = lp.clone().requires_grad_(True)
    loss, metrics = tpt.packed_loss(x, batch, cfg, metrics="tensor")
    loss.backward()
    return loss.detach(), x.grad, tpt.metrics_to_floats(metrics)


class SameAsKernel:
    def assert_same(self, got, want, what, kernel_grad_f32=True):
        """got: (loss, grad, metrics) of the torch loss; want: the kernel's (float32 gradient)."""
        loss, grad, metrics = got
        value, kgrad, kmetrics = want
        self.assertLessEqual(abs(float(loss) - value), 1e-12 * max(1.0, abs(value)), what)
        self.assertEqual(set(metrics), set(kmetrics))
        for k, v in kmetrics.items():
            self.assertLessEqual(abs(metrics[k] - v), 1e-12 * max(1.0, abs(v)), f"{what}: {k} {metrics[k]} != {v}")
        kgrad = kgrad.double()
        bound = F32_HALF_ULP * kgrad.abs() + 1e-15 * max(1.0, float(kgrad.abs().max()) if len(kgrad) else 0.0)
        self.assertTrue(bool(((grad - kgrad).abs() <= bound).all()), f"{what}: gradient beyond float32 rounding of the kernel's")


@needs_torch()
class TorchLossAgainstTheCore(SameAsKernel, unittest.TestCase):
    def test_every_option_on_every_shape(self):
        """All 225 configs (every policy x aggregation x kl x tis) on the 5 adversarial batches and the weighted mixed
        forest, a fifth of them on each other forest (every config on one or two of them), against tp_loss."""
        cases = shared = 0
        for k, (name, batch, lp) in enumerate(shapes()):
            m = batch["loss_mask"]
            shared += int(torch.bincount(batch["seq_positions"][m], minlength=1).max()) > 1 if bool(m.any()) else 0
            for i, cfg in enumerate(every_config()):
                if k < 10 and name != "mixed/1" and (i + k) % 5:
                    continue
                with self.subTest(shape=name, cfg=cfg):
                    self.assert_same(run_torch(lp, batch, cfg), kernel_loss(lp, batch, cfg, kernel="core"), name)
                cases += 1
        self.assertEqual(cases, 225 * 6 + 45 * 9)
        self.assertGreaterEqual(shared, 6)  # nodes whose gradient sums several trainable occurrences

    def test_gradient_at_1e12_against_the_plain_formula(self):
        """The per-occurrence float64 reference of test_packed_loss (no turn mode there; slow) on the same shapes, a
        quarter of the configs on each (every policy, aggregation, kl and tis among them)."""
        for k, (name, batch, lp) in enumerate(shapes()):
            for i, cfg in enumerate(every_config()):
                if cfg["aggregation"] == AGGREGATIONS[-1] or (i + k) % 4:
                    continue
                with self.subTest(shape=name, cfg=cfg):
                    loss, grad, metrics = run_torch(lp, batch, cfg)
                    y = torch.where(torch.isnan(lp), 0.0, lp)[batch["seq_positions"]].clone().requires_grad_(True)
                    ref, ref_metrics = plain_loss(y, batch, cfg)
                    ref.backward()
                    node = torch.zeros_like(lp).index_add_(0, batch["seq_positions"], y.grad)
                    self.assertLessEqual(abs(float(loss) - float(ref)), 1e-12 * max(1.0, abs(float(ref))))
                    worst = float((grad - node).abs().max()) if len(lp) else 0.0
                    self.assertLessEqual(worst, 1e-12 * max(1.0, float(node.abs().max()) if len(lp) else 0.0))

    def test_negative_control(self):
        """The comparison sees a one-option difference: tis_cap 1.5 against 2."""
        name, batch, lp = shapes()[4]
        cfg = {"tis": "token", "tis_cap": 1.5, "kl": "k3", "kl_coef": 0.1}
        got = run_torch(lp, batch, cfg)
        with self.assertRaises(AssertionError):
            self.assert_same(got, kernel_loss(lp, batch, {**cfg, "tis_cap": 2.0}, kernel="core"), name)

    def test_float32_and_bfloat16_lp(self):
        """The gradient comes back in lp's dtype; from float32 lp the values are those of the float64 run."""
        name, batch, lp = shapes()[2]
        cfg = {"policy": "gspo", "tis": "sequence", "kl": "k2", "kl_coef": 0.3}
        loss64, grad64, m64 = run_torch(lp, batch, cfg)
        loss32, grad32, m32 = run_torch(lp.float(), batch, cfg)
        self.assertEqual(grad32.dtype, torch.float32)
        self.assertEqual(grad64.dtype, torch.float64)
        self.assertEqual(float(loss32), float(loss64))
        self.assertTrue(torch.equal(grad32, grad64.float()))
        self.assertEqual(m32, m64)
        _, grad16, _ = run_torch(lp.bfloat16(), batch, cfg)
        self.assertEqual(grad16.dtype, torch.bfloat16)

    def test_docstring_example(self):
        """loss.py's hand-computed example in float64: −(1 + 1 − 0.5 − 0.5)/4, node 1 in both sequences."""
        mb = pack_sequences([[1, 2, 3], [1, 2, 4]], advantages=[1.0, -0.5], old_logprobs=[[0, -0.5, -0.2], [0, -0.5, -1.3]])
        batch = tpt.from_microbatch(mb)
        lp = torch.tensor([0, -0.5, -0.2, -1.3]).double().requires_grad_(True)  # the batch's float32 old_logprobs: ratio 1
        loss, metrics = tpt.packed_loss(lp, batch, {"clip_low": 0.2, "clip_high": 0.28})
        loss.backward()
        self.assertEqual(float(loss), -0.25)
        self.assertEqual(lp.grad.tolist(), [0.0, -0.125, -0.25, 0.125])
        self.assertEqual(metrics["trainable_tokens"], 4)
        self.assertEqual((metrics["ratio_min"], metrics["ratio_mean"], metrics["ratio_max"]), (1.0, 1.0, 1.0))

    def test_fixture_in_float64(self):
        with open(FIXTURE) as f:
            fx = json.load(f)
        batch, _ = fixture_batch(fx)
        batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
        lp = torch.zeros(int(batch["seq_positions"].max()) + 1, dtype=torch.float64)
        lp[batch["seq_positions"][1:]] = torch.tensor([x for s in fx["sequences"] for x in [0.0] + s["logprobs"]], dtype=torch.float64)[1:]
        for cfg, want in fixture_configs(fx):
            with self.subTest(cfg=cfg):
                self.assertAlmostEqual(float(tpt.packed_loss(lp, batch, cfg)[0]), want, delta=fx["tolerance"])


@needs_torch()
class SyncFreeAndCompiled(unittest.TestCase):
    CONFIGS = (
        {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "kl": "k3", "kl_coef": 0.1, "tis": "token"},
        {"policy": "gspo", "aggregation": "seq-mean-token-mean", "tis": "sequence", "log_ratio_clamp": 0.3},
        {"policy": "cispo", "aggregation": "seq-mean-turn-mean-token-mean", "kl": "abs", "kl_coef": 0.5, "loss_scale": 4.0},
    )

    def test_meta_tensors_read_no_value(self):
        """validate=False, metrics='tensor' runs on meta tensors (no data): no .item(), .cpu() or data-dependent branch."""
        _, batch, lp = shapes()[4]
        meta = {k: v.to("meta") for k, v in batch.items()}
        for cfg in self.CONFIGS:
            x = lp.to("meta").requires_grad_(True)
            loss, metrics = tpt.packed_loss(x, meta, cfg, validate=False, metrics="tensor")
            loss.backward()
            self.assertEqual((x.grad.device.type, metrics["ratio_mean"].device.type), ("meta", "meta"))
            with self.assertRaisesRegex(
                NotImplementedError, "meta tensor"
            ):  # the default reads values on the host, which meta tensors lack
                tpt.packed_loss(x, meta, cfg)

    def test_structural_checks_hold_without_validation(self):
        _, batch, lp = shapes()[4]
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_loss(lp, {k: v for k, v in batch.items() if k != "ref_logprobs"}, {"kl": "k1"}, validate=False)
        self.assertEqual(cm.exception.field, "ref_logprobs")

    def test_fullgraph_compile_equals_eager(self):
        """torch.compile(fullgraph=True): one graph, forward and backward (aot_eager traces both through AOTAutograd
        without code generation, which keeps the test fast; the Inductor run covers one config)."""
        _, batch, lp = shapes()[4]
        for i, cfg in enumerate(self.CONFIGS):
            loss_fn = tpt.PackedLoss(cfg, validate=False)
            compiled = torch.compile(loss_fn.__call__, fullgraph=True, backend="inductor" if i == 0 else "aot_eager")
            x, y = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
            loss_c, m_c = compiled(x, batch)
            loss_c.backward()
            loss_e, m_e = loss_fn(y, batch)
            loss_e.backward()
            with self.subTest(cfg=cfg):
                self.assertLessEqual(abs(float(loss_c) - float(loss_e)), 1e-12 * max(1.0, abs(float(loss_e))))
                self.assertLessEqual(float((m_c - m_e).abs().max()), 1e-12 * max(1.0, float(m_e.abs().max())))
                self.assertLessEqual(float((x.grad - y.grad).abs().max()), 1e-12 * max(1.0, float(y.grad.abs().max())))


def cuda_skip():
    """Why the CUDA library's kernels cannot run here ('' when they can); TREEPACK_REQUIRE_CUDA=1 makes it a failure."""
    try:
        cuda_library()
        return ""
    except (OSError, TreepackError) as e:
        if os.environ.get("TREEPACK_REQUIRE_CUDA") == "1":
            raise AssertionError(f"TREEPACK_REQUIRE_CUDA=1 but the CUDA library does not load: {e}") from e
        return f"the CUDA library does not load: {e}"


@needs_torch()
class TorchLossAgainstTheCudaKernels(SameAsKernel, unittest.TestCase):
    """tp_cuda_loss_host (host tensors; an emulated library runs it on the CPU) and, on a GPU, tp_cuda_loss on device
    pointers: the same bounds, fewer configs (the kernels are slow when emulated)."""

    def setUp(self):
        reason = cuda_skip()
        if reason:
            self.skipTest(reason)

    def configs(self):
        return [cfg for i, cfg in enumerate(every_config()) if i % 9 == 0]

    def test_sampled_options_on_every_shape(self):
        kernels = ["cuda-host"] + (["cuda"] if torch.cuda.is_available() else [])
        for kernel, (name, batch, lp), cfg in itertools.product(kernels, shapes()[3:], self.configs()):
            with self.subTest(kernel=kernel, shape=name, cfg=cfg):
                self.assert_same(run_torch(lp, batch, cfg), kernel_loss(lp, batch, cfg, kernel=kernel), f"{kernel} {name}")


@needs_torch(cuda="needs a CUDA device")
class TorchLossOnCuda(SameAsKernel, unittest.TestCase):
    def test_the_torch_loss_on_cuda_syncs_nothing(self):
        _, batch, lp = shapes()[4]
        dev = torch.device("cuda")
        on = {k: v.to(dev) for k, v in batch.items()}
        for cfg in SyncFreeAndCompiled.CONFIGS:
            x = lp.to(dev).requires_grad_(True)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss, metrics = tpt.packed_loss(x, on, cfg, validate=False, metrics="tensor")
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            got = (loss.detach().cpu(), x.grad.cpu(), tpt.metrics_to_floats(metrics))
            self.assert_same(got, kernel_loss(lp, batch, cfg, kernel="core"), "cuda")

    def test_the_torch_loss_in_a_cuda_graph(self):
        """Forward and backward captured once (torch.cuda.graph, the whole-network pattern), replayed on new lp."""
        _, batch, lp = shapes()[4]
        dev = torch.device("cuda")
        on = {k: v.to(dev) for k, v in batch.items()}
        loss_fn = tpt.PackedLoss(SyncFreeAndCompiled.CONFIGS[0], validate=False)
        x = lp.to(dev).requires_grad_(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph's documentation asks
            for _ in range(2):
                x.grad = None
                loss_fn(x, on)[0].backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        x.grad = None
        with torch.cuda.graph(graph):
            loss, metrics = loss_fn(x, on)
            loss.backward()
        other = torch.where(torch.isnan(lp), lp, lp - 0.125).float().double()
        with torch.no_grad():
            x.copy_(other.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        got = (loss.detach().cpu(), x.grad.cpu(), tpt.metrics_to_floats(dict(zip(tpt.METRICS, metrics.unbind(0)))))
        self.assert_same(got, kernel_loss(other, batch, SyncFreeAndCompiled.CONFIGS[0], kernel="core"), "cuda graph")


if __name__ == "__main__":
    unittest.main()
