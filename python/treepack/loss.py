"""The RL loss of a packed micro-batch from Python, through treepack's C ABI (ctypes, no Node).

CPU: ``libtreepack_core.so`` (``tp_loss``), CUDA: ``libtreepack_cuda.so`` (``tp_cuda_loss`` on device pointers);
where each is found: treepack/_native.py.

    >>> from treepack.loss import loss_numpy, PackedLoss
    >>> loss, grad, metrics = loss_numpy(mb, lp, {"clip_low": 0.2, "clip_high": 0.28})   # numpy arrays
    >>> loss, metrics = treepack.torch.packed_loss(lp_tensor, batch, config)                # torch, autograd

Config names, defaults, semantics and validation are those of src/loss/config.ts (README "Loss"); every error is a
TreepackError naming the field. Names, defaults, enum codes, status codes and struct layouts come from _abi.py,
generated from the same table as the C header (src/backend/abi.ts); a library built from other tables is refused.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from . import _abi, _native
from ._native import status_message
from .errors import TreepackError

POLICIES = _abi.POLICY_NAMES
AGGREGATIONS = _abi.AGGREGATION_NAMES
KL_ESTIMATORS = _abi.KL_NAMES
TIS_LEVELS = _abi.TIS_NAMES
DEFAULTS: Dict[str, Any] = dict(_abi.DEFAULTS)  # clip_high None: = clip_low


class LossConfig(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in _abi.ENUM_FIELDS] + [(n, ctypes.c_double) for n in _abi.NUMBER_FIELDS]


class LossMetrics(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64 if n == "trainable_tokens" else ctypes.c_double) for n in _abi.METRICS_FIELDS]

    def as_dict(self) -> Dict[str, float]:
        return {n: getattr(self, n) for n, _ in self._fields_}


def make_config(config: Optional[Mapping[str, Any]] = None) -> LossConfig:
    """Defaults filled, every field checked as src/loss/config.ts checks it (TreepackError E_ARG naming the field)."""
    if config is not None and not isinstance(config, Mapping):
        raise TreepackError("E_ARG", f"Expected an object for loss config but received {type(config).__name__}", field="loss config")
    given = dict(config or {})
    for key in given:
        if key not in DEFAULTS:
            raise TreepackError("E_ARG", f"unknown loss option {key!r}; expected one of {', '.join(DEFAULTS)}", field=key)
    c = {**DEFAULTS, **given}
    if "clip_high" not in given:  # as in TypeScript, only an absent clip_high means clip_low (None is refused)
        c["clip_high"] = c["clip_low"]

    def bad(name: str, expected: str) -> TreepackError:
        return TreepackError("E_ARG", f"Expected {expected} for {name} but received {c[name]!r}", field=name)

    codes = {}
    for name, table in (("policy", POLICIES), ("aggregation", AGGREGATIONS), ("kl", KL_ESTIMATORS), ("tis", TIS_LEVELS)):
        if not isinstance(c[name], str) or c[name] not in table:
            raise bad(name, f"one of {', '.join(table)}")
        codes[name] = table.index(c[name])
    for name, ok, expected in (
        ("clip_low", lambda x: x >= 0, "a number >= 0"),
        ("clip_high", lambda x: x >= 0, "a number >= 0"),
        ("dual_clip", lambda x: x == 0 or x > 1, "a number > 1 (or 0 for no dual clip)"),
        ("log_ratio_clamp", lambda x: x > 0, "a number > 0"),
        ("norm_constant", lambda x: x >= 0, "a number > 0"),
        ("global_tokens", lambda x: x >= 0, "a number >= 0 (0 = this micro-batch)"),
        ("global_sequences", lambda x: x >= 0, "a number >= 0 (0 = this micro-batch)"),
        ("kl_coef", lambda x: True, "a finite number"),
        ("tis_cap", lambda x: x > 0, "a number > 0"),
    ):
        v = c[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise bad(name, expected)
    if c["dual_clip"] != 0 and c["policy"] != "ppo":
        raise bad("dual_clip", f"0 with policy {c['policy']!r} (dual clip applies to ppo)")
    if c["aggregation"] == "seq-mean-token-sum-norm" and not c["norm_constant"] > 0:
        raise bad("norm_constant", "a number > 0 with aggregation 'seq-mean-token-sum-norm'")
    return LossConfig(**codes, **{k: float(c[k]) for k in _abi.NUMBER_FIELDS})


def cuda_status_error(lib: ctypes.CDLL, what: str, rc: int) -> TreepackError:
    """The TreepackError of a failed call of the CUDA C ABI: its status, and for a CUDA runtime failure the CUDA error."""
    detail = ""
    if rc in (_abi.TP_ERR_DEVICE, _abi.TP_ERR_ALLOC):
        code = lib.tp_cuda_last_error()
        detail = f" (CUDA error {code}: {lib.tp_cuda_error_string(code).decode()})"
    error = _abi.STATUSES[rc][2] if 0 < rc < len(_abi.STATUSES) else "E_BACKEND"
    return TreepackError(error, f"{what}: {status_message(rc)}{detail}", field="logprobs")


# The loader and the C signatures live in _native; these names stay for callers of treepack.loss.
core_library = _native.core
cuda_library = _native.cuda


_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def _needed(cfg: LossConfig, field: str) -> bool:
    return field in ("advantages", "old_logprobs") or (field == "ref_logprobs" and cfg.kl != 0) or (
        field == "rollout_logprobs" and cfg.tis != 0)


def loss_numpy(batch: Any, lp: np.ndarray, config: Optional[Mapping[str, Any]] = None) -> Tuple[float, np.ndarray, Dict[str, float]]:
    """Loss, dloss/dlp [N] (float32) and metrics on the CPU core. ``batch`` is a treepack.MicroBatch or a mapping
    with the contract's arrays (seq_offsets, seq_positions, loss_mask, advantages, old/ref/rollout logprobs)."""
    get = (lambda k: batch.get(k)) if isinstance(batch, Mapping) else (lambda k: getattr(batch, k, None))
    cfg = make_config(config)
    off = np.ascontiguousarray(get("seq_offsets"), dtype=np.int32)
    pos = np.ascontiguousarray(get("seq_positions"), dtype=np.int32)
    mask = np.ascontiguousarray(get("loss_mask"), dtype=np.uint8)
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    M, N = pos.shape[0], lp.shape[0]
    if off.shape[0] < 1 or off[-1] != M or mask.shape[0] != M:
        raise TreepackError("E_INPUT", f"seq_offsets ends at {off[-1] if off.shape[0] else None} and loss_mask has {mask.shape[0]} elements, but seq_positions has M = {M}", field="seq_offsets" if mask.shape[0] == M else "loss_mask")
    if M and (pos.min() < 0 or pos.max() >= N):
        raise TreepackError("E_INPUT", f"logprobs has {N} elements but seq_positions holds {pos.min() if pos.min() < 0 else pos.max()}", field="seq_positions" if pos.min() < 0 else "logprobs")
    arrays = {}
    for f in _FIELDS:
        a = get(f)
        if a is None:
            if _needed(cfg, f):
                raise TreepackError("E_INPUT", f"the loss config needs {f} but the batch has none", field=f)
            arrays[f] = None
            continue
        arrays[f] = np.ascontiguousarray(a, dtype=np.float32)
        if arrays[f].shape[0] != M:
            raise TreepackError("E_INPUT", f"{f} has {arrays[f].shape[0]} elements, expected M = {M}", field=f)
    trainable = mask != 0
    for name, a in (("logprobs", lp[pos]), *((f, arrays[f]) for f in _FIELDS if arrays[f] is not None and _needed(cfg, f))):
        if not np.isfinite(a[trainable]).all():
            raise TreepackError("E_INPUT", f"{name} has a non-finite value at a trainable position", field=name)
    grad = np.zeros(N, dtype=np.float32)
    metrics = LossMetrics()
    ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
    lib = core_library()
    rc = lib.tp_loss(ctypes.byref(cfg), off.shape[0] - 1, ptr(off), M, ptr(pos), ptr(mask), *(ptr(arrays[f]) for f in _FIELDS), N, ptr(lp), ptr(grad), ctypes.byref(metrics))
    if rc != 0:
        raise TreepackError(_abi.STATUSES[rc][2] if 0 < rc < len(_abi.STATUSES) else "E_BACKEND", f"tp_loss: {status_message(rc)}", field="seq_offsets")
    return metrics.loss, grad, metrics.as_dict()


def __getattr__(name: str):
    # The torch Function lives in treepack.torch.loss; imported only when asked for, so numpy users need no torch.
    if name == "PackedLoss":
        from .torch.loss import PackedLoss

        return PackedLoss
    raise AttributeError(name)
