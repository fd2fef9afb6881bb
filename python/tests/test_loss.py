"""The loss through ctypes on libtreepack_core.so against the float64 fixture (test/fixtures); the typed config; turn ids
from pack_sequences and the refusals of the turn mode; the torch Function when torch is installed (on the GPU
host: CUDA and CPU tensors against a plain torch implementation); the CUDA library's loss against the core's where
it finds a device (a GPU, or the CPU emulator: TREEPACK_CUDA_LIB=build-emu/Release/libtreepack_cuda.so). Each part
is skipped, with its reason, where its library or torch is missing."""

import ctypes
import dataclasses
import functools
import json
import os
import unittest

import numpy as np
import treepack
from treepack import _abi, _native
from treepack import loss as tl

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "test", "fixtures", "loss_reference.json")

try:
    tl.core_library()
    CORE_SKIP = ""
except tl.TreepackError as e:  # E_BACKEND: the C core is not built here
    CORE_SKIP = str(e)

try:
    import torch  # noqa: F401
    from treepack.torch import PackedLoss

    TORCH_SKIP = ""
except ImportError:
    TORCH_SKIP = "torch not installed (the torch tests run on the GPU host)"


def fixture_batch(fx):
    """The fixture's sequences with a leading untrainable token each; one node per occurrence (no sharing)."""
    off, pos, mask, fields, lp = [0], [], [], {f: [] for f in tl._FIELDS}, []
    for s in fx["sequences"]:
        n = len(s["logprobs"]) + 1
        for t in range(n):
            pos.append(len(lp))
            lp.append(0.0 if t == 0 else s["logprobs"][t - 1])
            mask.append(0 if t == 0 else 1)
            fields["advantages"].append(s["advantage"])
            for f in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
                fields[f].append(0.0 if t == 0 else s[f][t - 1])
        off.append(off[-1] + n)
    batch = {"seq_offsets": np.array(off), "seq_positions": np.array(pos), "loss_mask": np.array(mask)}
    batch.update({f: np.array(v, dtype=np.float32) for f, v in fields.items()})
    return batch, np.array(lp, dtype=np.float32)


@unittest.skipIf(CORE_SKIP != "", CORE_SKIP)
class CoreLossTest(unittest.TestCase):
    def setUp(self):
        with open(FIXTURE) as f:
            self.fx = json.load(f)
        self.batch, self.lp = fixture_batch(self.fx)
        p = self.fx["params"]
        self.vanilla = {
            "clip_low": p["clip_low"],
            "clip_high": p["clip_high"],
            "dual_clip": p["dual_clip_c"],
            "log_ratio_clamp": p["log_ratio_clamp"],
        }

    def test_fixture(self):
        e = self.fx["expected"]
        for agg, want in e["loss"].items():
            loss, _, _ = tl.loss_numpy(self.batch, self.lp, {**self.vanilla, "aggregation": agg, "norm_constant": 3})
            self.assertAlmostEqual(loss, want, delta=1e-6, msg=agg)
        loss, grad, m = tl.loss_numpy(self.batch, self.lp, self.vanilla)
        self.assertAlmostEqual(m["clipfrac_high"] + m["clipfrac_low"], e["pg_clipfrac"], delta=1e-6)
        self.assertAlmostEqual(m["approx_kl"], e["ppo_kl_token_mean"], delta=1e-6)
        self.assertEqual(m["trainable_tokens"], 5)
        cispo, _, _ = tl.loss_numpy(self.batch, self.lp, {"clip_low": 0.2, "clip_high": 0.28, "policy": "cispo"})
        self.assertAlmostEqual(cispo, e["cispo_token_mean"], delta=1e-6)
        # Gradient against central differences in float32 inputs (coarse: the kernel reads float32 logprobs).
        for p in range(len(self.lp)):
            up, down = self.lp.copy(), self.lp.copy()
            up[p] += 1e-2
            down[p] -= 1e-2
            fd = (tl.loss_numpy(self.batch, up, self.vanilla)[0] - tl.loss_numpy(self.batch, down, self.vanilla)[0]) / 2e-2
            self.assertAlmostEqual(grad[p], fd, delta=2e-3, msg=f"d/dlp[{p}]")

    def test_bad_input(self):
        with self.assertRaisesRegex(ValueError, "policy"):
            tl.make_config({"policy": "ppo2"})
        with self.assertRaisesRegex(ValueError, "dual_clip"):
            tl.make_config({"dual_clip": 1})
        with self.assertRaisesRegex(ValueError, "clip_low"):
            tl.make_config({"clip_low": -1})
        with self.assertRaisesRegex(ValueError, "unknown loss option"):
            tl.make_config({"clip": 1})
        bad = self.lp.copy()
        bad[1] = np.nan
        with self.assertRaisesRegex(ValueError, "logprobs"):
            tl.loss_numpy(self.batch, bad, self.vanilla)
        with self.assertRaisesRegex(ValueError, "logprobs has 3 elements"):
            tl.loss_numpy(self.batch, self.lp[:3], self.vanilla)


class TypedConfigTest(unittest.TestCase):
    """treepack.LossConfig: the dict's names, defaults and checks, each field documented where it is declared."""

    def test_fields_defaults_and_help(self):
        fields = dataclasses.fields(tl.LossConfig)
        self.assertEqual([f.name for f in fields], list(tl.DEFAULTS))
        for f in fields:
            self.assertTrue(f.metadata.get("help"), f.name)
        self.assertEqual(tl.LossConfig().to_dict(), {**tl.DEFAULTS, "clip_high": tl.DEFAULTS["clip_low"]})
        self.assertEqual(tl.LossConfig(clip_low=0.1).clip_high, 0.1)
        self.assertIs(treepack.LossConfig, tl.LossConfig)

    def test_same_checks_as_the_dict(self):
        for kwargs, name in (
            ({"policy": "ppo2"}, "policy"),
            ({"dual_clip": 1}, "dual_clip"),
            ({"clip_low": -1}, "clip_low"),
            ({"loss_scale": -2}, "loss_scale"),
            ({"loss_scale": float("nan")}, "loss_scale"),
            ({"aggregation": "seq-mean-token-sum-norm"}, "norm_constant"),
            ({"policy": "cispo", "dual_clip": 2}, "dual_clip"),
        ):
            with self.subTest(kwargs=kwargs):
                for build in (functools.partial(tl.LossConfig, **kwargs), functools.partial(tl.make_config, kwargs)):
                    with self.assertRaises(tl.TreepackError) as cm:
                        build()
                    self.assertEqual(cm.exception.field, name)

    @unittest.skipIf(CORE_SKIP != "", CORE_SKIP)
    def test_typed_and_dict_give_the_same_loss(self):
        mb = treepack.pack_sequences([[1, 2, 3, 4], [1, 2, 5]])
        r = np.random.default_rng(0)
        M, N = len(mb.seq_positions), len(mb.input_ids)
        mb.advantages = r.standard_normal(M).astype(np.float32)
        mb.old_logprobs = (-r.random(M)).astype(np.float32)
        lp = (-r.random(N)).astype(np.float32)
        cfg = {"clip_low": 0.1, "aggregation": "seq-mean-token-mean", "loss_scale": 3.0}
        a = tl.loss_numpy(mb, lp, tl.LossConfig(**cfg))
        b = tl.loss_numpy(mb, lp, cfg)
        self.assertEqual(a[0], b[0])
        self.assertTrue(np.array_equal(a[1], b[1]))


@unittest.skipIf(CORE_SKIP != "", CORE_SKIP)
class TurnsTest(unittest.TestCase):
    """pack_sequences' turns, the forest check of turn_ids, and the loss's refusals naming the field."""

    def setUp(self):
        self.mb = treepack.pack_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6]], turns=[[1, 3], [1]])
        M, N = len(self.mb.seq_positions), len(self.mb.input_ids)
        self.mb.advantages = np.linspace(-1, 1, M).astype(np.float32)
        self.mb.old_logprobs = np.full(M, -1.0, dtype=np.float32)
        self.lp = np.linspace(-2, -0.5, N).astype(np.float32)

    def test_turn_ids(self):
        self.assertEqual(self.mb.turn_ids.tolist(), [-1, 0, 0, 1, 1, -1, 0, 0, 0])
        self.assertEqual(treepack.check_invariants(self.mb), [])
        self.mb.turn_ids[3] = -4
        self.assertEqual(
            treepack.check_invariants(self.mb), ["turn_ids decreasing along a sequence (1): turn_ids[3] = -4 after 0 (sequence 0, t = 3)"]
        )
        for turns in ([[3, 1], [1]], [[1, 5], [1]], [[1]]):
            with self.assertRaises(tl.TreepackError) as cm:
                treepack.pack_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6]], turns=turns)
            self.assertEqual(cm.exception.field, "turns")

    def test_empty_batch(self):
        mb = treepack.pack_sequences([], turns=[])
        mb.advantages = mb.old_logprobs = np.zeros(0, dtype=np.float32)
        for turn_ids in (mb.turn_ids, None):  # nothing to aggregate: no turn ids needed either
            loss, grad, m = tl.loss_numpy(
                dataclasses.replace(mb, turn_ids=turn_ids),
                np.zeros(0, dtype=np.float32),
                {"aggregation": "seq-mean-turn-mean-token-mean", "loss_scale": 3},
            )
            self.assertEqual((loss, grad.size, m["trainable_tokens"]), (0.0, 0, 0))

    def test_refusals_name_the_field(self):
        turns = {"aggregation": "seq-mean-turn-mean-token-mean"}
        mb = dataclasses.replace(self.mb, turn_ids=None)
        for batch, name in ((mb, "turn_ids"), (dataclasses.replace(self.mb, turn_ids=self.mb.turn_ids[::-1].copy()), "turn_ids")):
            with self.assertRaises(tl.TreepackError) as cm:
                tl.loss_numpy(batch, self.lp, turns)
            self.assertEqual(cm.exception.field, name)
        as_dict = {k: getattr(self.mb, k) for k in ("seq_offsets", "seq_positions", "loss_mask", "advantages", "old_logprobs", "turn_ids")}
        for sw in (np.array([1.0, -1.0]), np.array([1.0, np.inf]), np.array([1.0])):
            with self.assertRaises(tl.TreepackError) as cm:
                tl.loss_numpy({**as_dict, "seq_weight": sw}, self.lp, turns)
            self.assertEqual(cm.exception.field, "seq_weight")
        # turn_ids are read by the turn mode only; one turn per sequence there is seq-mean-token-mean.
        one = {**as_dict, "turn_ids": np.zeros_like(self.mb.turn_ids)}
        self.assertAlmostEqual(
            tl.loss_numpy(one, self.lp, turns)[0], tl.loss_numpy(one, self.lp, {"aggregation": "seq-mean-token-mean"})[0], delta=1e-7
        )


def cuda_device_name(lib):
    """The first CUDA device's name as libtreepack_cuda.so reports it ('' without one)."""

    runtime, driver, count, dev = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32(), _abi.tp_cuda_device()
    rc = lib.tp_cuda_device_info(ctypes.byref(runtime), ctypes.byref(driver), ctypes.byref(count), ctypes.byref(dev), 1)
    return dev.name.decode() if rc == 0 and count.value > 0 else ""


try:
    CUDA_LIB = tl.cuda_library()
    CUDA_SKIP = "" if cuda_device_name(CUDA_LIB) else "libtreepack_cuda.so finds no CUDA device"
except tl.TreepackError as e:  # E_BACKEND: not built here (TREEPACK_CUDA_LIB names one, e.g. the emulated build)
    CUDA_SKIP = str(e)


@unittest.skipIf(CORE_SKIP != "" or CUDA_SKIP != "", CORE_SKIP or CUDA_SKIP)
class CudaLibraryLossTest(unittest.TestCase):
    """tp_cuda_loss_host (and, on the CPU emulator of native/cuda/emulate, whose device memory is host memory,
    tp_cuda_loss itself) against tp_loss: the configurations of the notes' probe on forests with shared prefixes,
    sequences over 128 tokens (several blocks of the reductions) and an empty sequence."""

    CONFIGS = [
        {},
        {"policy": "gspo", "aggregation": "seq-mean-token-mean"},
        {"policy": "cispo", "kl": "k3", "kl_coef": 0.1, "tis": "token", "tis_cap": 1.5},
        {"aggregation": "seq-mean-turn-mean-token-mean", "tis": "sequence", "dual_clip": 3.0, "clip_high": 0.28},
    ]

    def batch(self, seed):
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, 50, size=int(rng.integers(1, 300))).tolist() for _ in range(3)]
        seqs = [p + rng.integers(0, 50, size=int(rng.integers(0, 200))).tolist() for p in prompts for _ in range(3)] + [[7]]
        turns = [sorted(set(rng.integers(1, len(s), size=2).tolist())) if len(s) > 2 else [] for s in seqs]
        mb = treepack.pack_sequences(seqs, turns=turns)
        M, N = len(mb.seq_positions), len(mb.input_ids)
        for f in tl._FIELDS:
            setattr(mb, f, rng.normal(-1.0, 0.3, size=M).astype(np.float32))
        mb.advantages = rng.normal(0, 1, size=M).astype(np.float32)
        return mb, rng.normal(-1.0, 0.3, size=N).astype(np.float32)

    def cuda_loss(self, entry, mb, lp, config):
        cfg = tl.make_config(config)
        arrays = [
            np.ascontiguousarray(a, dtype=t)
            for a, t in (
                (mb.seq_offsets, np.int32),
                (mb.seq_positions, np.int32),
                (mb.loss_mask, np.uint8),
                (mb.advantages, np.float32),
                (mb.old_logprobs, np.float32),
                (mb.ref_logprobs, np.float32),
                (mb.rollout_logprobs, np.float32),
                (mb.turn_ids, np.int32),
            )
        ]
        off, pos, mask, adv, old, ref, roll, turn = arrays
        grad, metrics = np.zeros(lp.size, dtype=np.float32), tl.LossMetrics()
        P = _native.pointer
        args = [
            ctypes.byref(cfg),
            off.size - 1,
            P(off),
            pos.size,
            P(pos),
            P(mask),
            P(adv),
            P(old),
            P(ref),
            P(roll),
            None,
            P(turn),
            lp.size,
            P(lp),
            P(grad),
            ctypes.byref(metrics),
        ]
        rc = getattr(CUDA_LIB, entry)(*args, *([None] if entry == "tp_cuda_loss" else []))
        self.assertEqual(rc, 0, tl.status_message(rc))
        return metrics.loss, grad, metrics.as_dict()

    def test_against_the_core(self):
        entries = ["tp_cuda_loss_host"] + (["tp_cuda_loss"] if "emulated" in cuda_device_name(CUDA_LIB) else [])
        for seed in range(3):
            mb, lp = self.batch(seed)
            self.assertLess(len(mb.input_ids), len(mb.seq_positions))  # shared prefixes: nodes with several occurrences
            for config in self.CONFIGS:
                _, want_grad, want = tl.loss_numpy(mb, lp, config)
                for entry in entries:
                    with self.subTest(seed=seed, config=config, entry=entry):
                        _, grad, got = self.cuda_loss(entry, mb, lp, config)
                        # Every sum in the same order as the core's (treepack_cuda.h): gradients to float rounding,
                        # metrics to double rounding.
                        np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)
                        for k, v in want.items():
                            self.assertAlmostEqual(got[k], v, delta=1e-12 * max(1.0, abs(v)), msg=k)


@unittest.skipIf(TORCH_SKIP != "" or CORE_SKIP != "", TORCH_SKIP or CORE_SKIP)
class TorchLossTest(unittest.TestCase):
    def _plain_torch(self, batch, lp, c):
        """verl's vanilla PPO loss with dual clip on the unpacked batch, token-mean, in plain torch autograd."""
        g = lp[batch["seq_positions"].long()]
        m = batch["loss_mask"].bool()
        r = torch.exp(torch.clamp(g - batch["old_logprobs"], -20, 20))
        A = batch["advantages"]
        l1, l2 = -A * r, -A * torch.clamp(r, 1 - c["clip_low"], 1 + c["clip_high"])
        L = torch.maximum(l1, l2)
        L = torch.where(A < 0, torch.minimum(L, -A * c["dual_clip"]), L)
        return (L * m).sum() / m.sum()

    def test_against_plain_torch(self):
        with open(FIXTURE) as f:
            fx = json.load(f)
        batch, lp = fixture_batch(fx)
        p = fx["params"]
        c = {"clip_low": p["clip_low"], "clip_high": p["clip_high"], "dual_clip": p["dual_clip_c"]}
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for dev in devices:
            t = {k: torch.from_numpy(np.asarray(v)).to(dev) for k, v in batch.items()}
            t["seq_offsets"] = t["seq_offsets"].int()
            t["seq_positions"] = t["seq_positions"].int()
            t["loss_mask"] = t["loss_mask"].to(torch.uint8)
            x = torch.tensor(lp, device=dev, requires_grad=True)
            PackedLoss.apply(x, t, c)[0].backward()
            y = torch.tensor(lp, dtype=torch.float64, device=dev, requires_grad=True)
            ref = self._plain_torch({k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}, y, c)
            ref.backward()
            self.assertAlmostEqual(float(ref), fx["expected"]["loss"]["token-mean"], delta=1e-6)
            self.assertTrue(torch.allclose(x.grad.double(), y.grad, atol=1e-6), dev)


if __name__ == "__main__":
    unittest.main()
