"""The CUDA library (libtreepack_cuda.so) against the C core (libtreepack_core.so), through the ctypes bindings of
treepack._native (TREEPACK_CUDA_LIB and TREEPACK_CORE_LIB select the files): for scripts/gpu-check.sh.

    python scripts/gpu_check/cuda_vs_core.py                 # on a CUDA host
    python scripts/gpu_check/cuda_vs_core.py --self-test     # anywhere: the core against itself (the driver's proof)

Checked, on random and adversarial forests (empty, one token, duplicates, a sequence that is a prefix of another,
depth >= 30, a 600-wide fan-out, ragged last blocks, and with --large a forest of >= 128k tokens):
- the masks bit for bit: dense and bits (n <= 3000), blocks at B = 1 (n <= 3000), 4, 16 (n <= 20000) and 128;
- the gather with indices out of range (0 there) against numpy;
- the loss in five configurations (ppo; gspo; cispo + k3 + token TIS; the turn mean + sequence TIS + dual clip;
  seq-mean-token-sum-norm + k2 + seq_weight + loss_scale): metrics within 1e-9 relative, grad within 1e-6 of its
  largest magnitude (the kernels' sums run in another order, then round to float32: native/cuda/treepack_cuda.h).
Every comparison kind also runs once on a planted fault (one flipped mask entry, a perturbed gradient or metric),
which it must report: a comparison that cannot fail proves nothing. Prints one ``SUMMARY:`` line; exit 1 on any
difference.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import treepack  # noqa: E402
from treepack import _native  # noqa: E402
from treepack import loss as tl  # noqa: E402

Arrays = tuple[np.ndarray, ...]


def forests(large: bool) -> dict[str, list[list[int]]]:
    r = random.Random(7)
    tok = lambda n, v=50: [r.randrange(1, v) for _ in range(n)]  # noqa: E731  (small vocabularies: shared prefixes)
    out: dict[str, list[list[int]]] = {
        "empty": [],
        "one token": [[5]],
        "duplicates": [[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3]],
        "prefix of another": [[1, 2], [1, 2, 3, 4, 5], [1], [1, 2, 3]],
    }
    deep = [tok(8)]
    for _ in range(40):  # 40 nested branch points: depth of the branching >= 30
        deep.append(deep[-1][: len(deep[-1]) - r.randrange(1, 3)] + tok(r.randrange(3, 9)))
    out["deep (40 nested branches)"] = deep
    out["wide (600 children)"] = [[9, 9, 9, t] + tok(r.randrange(0, 4)) for t in range(1, 601)]
    for i, (count, length) in enumerate(((30, 60), (200, 90))):
        seqs: list[list[int]] = []
        for _ in range(count):
            base = r.choice(seqs) if seqs and r.random() < 0.8 else []
            seqs.append(base[: r.randrange(0, len(base) + 1)] + tok(r.randrange(1, length)))
        out[f"random {i} ({count} sequences)"] = seqs
    if large:  # >= 128k nodes: 40 calls sharing a 12k prompt, each with 3.3k tokens of its own
        prompt = tok(12000, 30000)
        out["large (>= 128k tokens)"] = [prompt + tok(3300, 30000) for _ in range(40)]
    return out


class Core:
    """The reference: the C core's masks and loss, numpy's gather."""

    name = "core"

    def __init__(self) -> None:
        self.lib = _native.core()

    def dense(self, parent: np.ndarray, se: np.ndarray) -> tuple[int, Arrays]:
        out = np.zeros(len(se) * len(se), dtype=np.uint8)
        return self.lib.tp_mask_dense(_p(parent), _p(se), len(se), _p(out)), (out,)

    def bits(self, parent: np.ndarray, se: np.ndarray) -> tuple[int, Arrays]:
        out = np.zeros(len(se) * ((len(se) + 31) // 32), dtype=np.uint32)
        return self.lib.tp_mask_bits(_p(parent), _p(se), len(se), _p(out)), (out,)

    def blocks(self, se: np.ndarray, B: int) -> tuple[int, Arrays]:
        a = _block_arrays(len(se), B)
        return self.lib.tp_mask_blocks(_p(se), len(se), B, *map(_p, a)), a

    def gather(self, src: np.ndarray, idx: np.ndarray) -> tuple[int, Arrays]:
        ok = (idx >= 0) & (idx < len(src))
        picked = src[np.where(ok, idx, 0)] if len(src) else np.zeros(len(idx), dtype=np.int32)
        return 0, (np.where(ok, picked, 0).astype(np.int32),)

    def loss(self, *args: Any) -> int:
        return self.lib.tp_loss(*args)


class Cuda(Core):
    """The CUDA library's host-array forms (copy in, kernels, copy back)."""

    name = "cuda"

    def __init__(self) -> None:
        self.lib = _native.cuda()

    def dense(self, parent: np.ndarray, se: np.ndarray) -> tuple[int, Arrays]:
        out = np.full(len(se) * len(se), 7, dtype=np.uint8)  # not zeros: every entry must be written
        return self.lib.tp_cuda_mask_dense_host(_p(parent), _p(se), len(se), _p(out), None), (out,)

    def bits(self, parent: np.ndarray, se: np.ndarray) -> tuple[int, Arrays]:
        out = np.full(len(se) * ((len(se) + 31) // 32), 0xA5A5A5A5, dtype=np.uint32)
        return self.lib.tp_cuda_mask_bits_host(_p(parent), _p(se), len(se), _p(out), None), (out,)

    def blocks(self, se: np.ndarray, B: int) -> tuple[int, Arrays]:
        a = _block_arrays(len(se), B, fill=-7)
        return self.lib.tp_cuda_mask_blocks_host(_p(se), len(se), B, *map(_p, a), None), a

    def gather(self, src: np.ndarray, idx: np.ndarray) -> tuple[int, Arrays]:
        out = np.full(len(idx), -7, dtype=np.int32)
        return self.lib.tp_cuda_gather_i32_host(_p(src), len(src), _p(idx), len(idx), _p(out)), (out,)

    def loss(self, *args: Any) -> int:
        return self.lib.tp_cuda_loss_host(*args)


_p = _native.pointer


def _block_arrays(n: int, B: int, fill: int = 0) -> Arrays:
    nb = (n + B - 1) // B
    return tuple(np.full(k, fill, dtype=np.int32) for k in (nb, nb * nb, nb, nb * nb))


LOSS_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("ppo token-mean", {"clip_low": 0.2, "clip_high": 0.28}),
    ("gspo seq-mean-token-mean", {"policy": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq-mean-token-mean"}),
    ("cispo + k3 + token TIS", {"policy": "cispo", "clip_high": 0.28, "kl": "k3", "kl_coef": 0.05, "tis": "token", "tis_cap": 2.0}),
    (
        "turn mean + sequence TIS + dual clip",
        {"aggregation": "seq-mean-turn-mean-token-mean", "tis": "sequence", "tis_cap": 1.5, "dual_clip": 3.0},
    ),
    (
        "token-sum-norm + k2 + seq_weight + scale",
        {"aggregation": "seq-mean-token-sum-norm", "norm_constant": 64, "kl": "k2", "kl_coef": 0.1, "loss_scale": 4.0, "seq_weight": True},
    ),
]


def loss_inputs(seqs: list[list[int]], seed: int) -> tuple[treepack.MicroBatch, np.ndarray]:
    r = np.random.default_rng(seed)
    turns = [sorted({1} | set(r.integers(1, max(2, len(s)), 2).tolist())) if len(s) > 1 else [] for s in seqs]
    mb = treepack.pack_sequences(seqs, turns=turns)
    M, N = len(mb.seq_positions), len(mb.input_ids)
    mb.loss_mask = (mb.loss_mask * (r.random(M) < 0.8)).astype(np.uint8)
    mb.advantages = r.standard_normal(M).astype(np.float32)
    for f in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        setattr(mb, f, (-r.random(M) * 3).astype(np.float32))
    lp = (-r.random(N) * 3).astype(np.float32)
    return mb, lp


def run_loss(impl: Core, mb: treepack.MicroBatch, lp: np.ndarray, config: dict[str, Any]) -> tuple[int, Arrays]:
    """tp_loss's arguments (the CUDA host form takes the same) of a packed batch with every field present."""
    config = dict(config)
    sw = np.linspace(0.5, 2.0, len(mb.seq_offsets) - 1).astype(np.float32) if config.pop("seq_weight", False) else None
    cfg = tl.make_config(config)
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    off, pos, turn = i32(mb.seq_offsets), i32(mb.seq_positions), i32(mb.turn_ids)
    mask = np.ascontiguousarray(mb.loss_mask, dtype=np.uint8)
    floats = [np.ascontiguousarray(getattr(mb, f), dtype=np.float32) for f in tl._FIELDS]
    grad = np.full(len(lp), np.nan, dtype=np.float32)
    metrics = tl.LossMetrics()
    rc = impl.loss(
        ctypes.byref(cfg),
        len(off) - 1,
        _p(off),
        len(pos),
        _p(pos),
        _p(mask),
        *map(_p, floats),
        _p(sw),
        _p(turn),
        len(lp),
        _p(lp),
        _p(grad),
        ctypes.byref(metrics),
    )
    values = metrics.as_dict()
    return rc, (grad, np.array([values[k] for k in sorted(values)], dtype=np.float64))


def exact(want: Arrays, got: Arrays) -> str:
    for i, (a, b) in enumerate(zip(want, got)):
        if a.shape != b.shape or not np.array_equal(a, b):
            bad = np.flatnonzero(a != b) if a.shape == b.shape else []
            return f"output {i} differs" + (f" at {len(bad)} entries, first {int(bad[0])}: {a[bad[0]]} vs {b[bad[0]]}" if len(bad) else "")
    return ""


def close_loss(want: Arrays, got: Arrays) -> str:
    (g0, m0), (g1, m1) = want, got
    scale = max(float(np.abs(g0).max(initial=0.0)), 1e-30)
    dg = float(np.abs(g0.astype(np.float64) - g1).max(initial=0.0))
    if not np.isfinite(g1).all() or dg > 1e-6 * scale:
        return f"grad differs by {dg:.3g} (largest |grad| {scale:.3g})"
    rel = np.abs(m0 - m1) / np.maximum(np.maximum(np.abs(m0), np.abs(m1)), 1e-12)
    if not (rel <= 1e-9).all():
        return f"metric {int(np.argmax(rel))} differs by {float(rel.max()):.3g} relative"
    return ""


def planted(got: Arrays, kind: str) -> Arrays:
    """``got`` with one planted fault: a flipped entry (masks, gather), a nudged gradient or metric (loss)."""
    out = tuple(a.copy() for a in got)
    if kind == "loss":
        g = out[0]
        g[np.argmax(np.abs(g))] += np.float32(1e-4) * max(float(np.abs(g).max(initial=0.0)), 1.0)
        return out
    a = next(a for a in out if a.size)
    a[a.size // 2] = a[a.size // 2] ^ 1 if a.dtype.kind in "ui" else 1 - a[a.size // 2]
    return out


class Tally:
    def __init__(self) -> None:
        self.checks: dict[str, int] = {}
        self.failures: list[str] = []
        self.controls: dict[str, bool] = {}

    def compare(
        self, kind: str, what: str, want: tuple[int, Arrays], got: tuple[int, Arrays], rule: Callable[[Arrays, Arrays], str]
    ) -> None:
        self.checks[kind] = self.checks.get(kind, 0) + 1
        if want[0] != got[0]:
            self.failures.append(f"{kind} {what}: status {got[0]} ({_native.status_message(got[0])}), core {want[0]}")
            return
        problem = rule(want[1], got[1]) if want[0] == 0 else ""
        if problem:
            self.failures.append(f"{kind} {what}: {problem}")
        elif want[0] == 0 and kind not in self.controls and any(a.size for a in got[1]):
            # The negative control: the same comparison must report one planted fault.
            self.controls[kind] = bool(rule(want[1], planted(got[1], "loss" if kind.startswith("loss") else kind)))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--self-test", action="store_true", help="no CUDA: the C core against itself (every comparison equal, every planted fault caught)"
    )
    ap.add_argument("--large", action="store_true", help="add a forest of >= 128k tokens")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    core = Core()
    try:
        other = Core() if a.self_test else Cuda()
    except treepack.TreepackError as e:
        print(f"SUMMARY: the CUDA library did not load: {e}")
        return 1
    one = np.zeros(1, dtype=np.int32)
    rc, _ = other.gather(one, one)
    if rc:  # no driver or no device: one line that says so, instead of a failure per comparison
        code = other.lib.tp_cuda_last_error()
        print(
            f"SUMMARY: the CUDA library cannot run here: {_native.status_message(rc)}, CUDA error {code}: "
            f"{other.lib.tp_cuda_error_string(code).decode()}"
        )
        return 1
    tally = Tally()
    nodes = 0
    for name, seqs in forests(a.large).items():
        mb = treepack.pack_sequences(seqs)
        parent, se = (np.ascontiguousarray(x, dtype=np.int32) for x in (mb.parent, mb.subtree_end))
        n = len(se)
        nodes += n
        if n <= 3000:
            tally.compare("dense", name, core.dense(parent, se), other.dense(parent, se), exact)
            tally.compare("bits", name, core.bits(parent, se), other.bits(parent, se), exact)
        for B in (1, 4, 16, 128):
            if (B == 1 and n > 3000) or (B < 128 and n > 20000):
                continue  # nb² entries: the small blocks only where they fit
            tally.compare(f"blocks B={B}", name, core.blocks(se, B), other.blocks(se, B), exact)
        idx = np.ascontiguousarray(np.concatenate([np.asarray(mb.seq_positions), [-1, n, n + 5, -(2**31)]]), dtype=np.int32)
        ids = np.ascontiguousarray(mb.input_ids, dtype=np.int32)
        tally.compare("gather", name, core.gather(ids, idx), other.gather(ids, idx), exact)
        if n:
            batch, lp = loss_inputs(seqs, seed=n)
            for label, config in LOSS_CONFIGS:
                want, got = run_loss(core, batch, lp, config), run_loss(other, batch, lp, config)
                tally.compare("loss", f"{label} on {name}", want, got, close_loss)
    missed = sorted(k for k, caught in tally.controls.items() if not caught)
    for f in tally.failures:
        print("FAIL", f)
    for k in missed:
        print(f"FAIL negative control: a planted fault in {k} was not reported")
    counts = ", ".join(f"{k} {v}" for k, v in tally.checks.items())
    verdict = f"{len(tally.failures)} differences, " + (f"{len(missed)} planted faults missed" if missed else "every planted fault caught")
    against = "core vs core (self-test)" if a.self_test else "CUDA vs core"
    print(
        f"SUMMARY: {against}: {sum(tally.checks.values())} comparisons ({counts}) on {len(forests(a.large))} forests, {nodes} nodes; "
        f"{verdict}; {time.perf_counter() - t0:.1f} s"
    )
    return 1 if tally.failures or missed else 0


if __name__ == "__main__":
    sys.exit(main())
