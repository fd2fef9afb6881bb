"""The RL loss of a packed micro-batch from Python, through treepack's C ABI (ctypes, no Node).

CPU: ``libtreepack_core.so`` (``tp_loss``; ``npm run build:cuda`` builds it into build-cmake/Release, or set
TREEPACK_CORE_LIB). CUDA: ``libtreepack_cuda.so`` (``tp_cuda_loss`` on device pointers; TREEPACK_CUDA_LIB).

    >>> from treepack.loss import loss_numpy, PackedLoss
    >>> loss, grad, metrics = loss_numpy(mb, lp, {"clip_low": 0.2, "clip_high": 0.28})   # numpy arrays
    >>> loss = PackedLoss.apply(lp_tensor, batch_tensors, config)                          # torch, autograd

Config names, defaults, enum codes, status codes and struct layouts come from _abi.py, generated from the same
table as the C header (src/backend/abi.ts); a library built from other tables is refused at load. make_config
checks every field as src/loss/config.ts does (ValueError naming the field).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import math

import numpy as np

from . import _abi

POLICIES = _abi.POLICY_NAMES
AGGREGATIONS = _abi.AGGREGATION_NAMES
KL_ESTIMATORS = _abi.KL_NAMES
TIS_LEVELS = _abi.TIS_NAMES
DEFAULTS: Dict[str, Any] = dict(_abi.DEFAULTS)
_ENUMS = {"policy": POLICIES, "aggregation": AGGREGATIONS, "kl": KL_ESTIMATORS, "tis": TIS_LEVELS}


class LossConfig(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in _abi.ENUM_FIELDS] + [(n, ctypes.c_double) for n in _abi.NUMBER_FIELDS]


class LossMetrics(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64 if n == "trainable_tokens" else ctypes.c_double) for n in _abi.METRICS_FIELDS]

    def as_dict(self) -> Dict[str, float]:
        return {n: getattr(self, n) for n, _ in self._fields_}


# Each number field: its check and what the message expects (src/loss/config.ts resolveLossConfig).
_RANGES = {
    "clip_low": (lambda x: x >= 0, "a number >= 0"),
    "clip_high": (lambda x: x >= 0, "a number >= 0"),
    "dual_clip": (lambda x: x == 0 or x > 1, "a number > 1 (or 0 for no dual clip)"),
    "log_ratio_clamp": (lambda x: x > 0, "a number > 0"),
    "norm_constant": (lambda x: x >= 0, "a number > 0"),
    "global_tokens": (lambda x: x >= 0, "a number >= 0 (0 = this micro-batch)"),
    "global_sequences": (lambda x: x >= 0, "a number >= 0 (0 = this micro-batch)"),
    "kl_coef": (lambda x: True, "a finite number"),
    "tis_cap": (lambda x: x > 0, "a number > 0"),
}


def make_config(config: Optional[Mapping[str, Any]] = None) -> LossConfig:
    """Defaults filled, names and ranges checked as src/loss/config.ts does (ValueError naming the field)."""
    given = dict(config or {})
    for key in given:
        if key not in DEFAULTS:
            raise ValueError(f"unknown loss option {key!r}; expected one of {', '.join(DEFAULTS)}")
    c = {**DEFAULTS, **given}
    if given.get("clip_high") is None:
        c["clip_high"] = c["clip_low"]
    codes = {}
    for name, table in _ENUMS.items():
        if not isinstance(c[name], str) or c[name] not in table:
            raise ValueError(f"Expected one of {', '.join(table)} for {name} but received {c[name]!r}")
        codes[name] = table.index(c[name])
    for name, (ok, expected) in _RANGES.items():
        v = c[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise ValueError(f"Expected {expected} for {name} but received {v!r}")
    if c["dual_clip"] != 0 and c["policy"] != "ppo":
        raise ValueError(f"Expected 0 with policy {c['policy']!r} (dual clip applies to ppo) for dual_clip but received {c['dual_clip']!r}")
    if c["aggregation"] == "seq-mean-token-sum-norm" and not c["norm_constant"] > 0:
        raise ValueError(f"Expected a number > 0 with aggregation 'seq-mean-token-sum-norm' for norm_constant but received {c['norm_constant']!r}")
    return LossConfig(**codes, **{k: float(c[k]) for k in _abi.NUMBER_FIELDS})


def status_message(code: int) -> str:
    """The name and message of a status of the C ABIs (CPU and CUDA share them)."""
    if 0 <= code < len(_abi.STATUSES):
        name, message, _ = _abi.STATUSES[code]
        return f"{name}: {message}"
    return f"unknown treepack status {code}"


def _library(env: str, name: str) -> ctypes.CDLL:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ[env]] if os.environ.get(env) else [
        os.path.join(here, "..", "..", "build-cmake", "Release", name),
        os.path.join(here, "..", "..", "build-cmake", name),
    ]
    errors = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(os.path.abspath(path))
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        abi_fn = getattr(lib, "tp_abi" if name == "libtreepack_core.so" else "tp_cuda_abi", None)
        if abi_fn is None:
            errors.append(f"{path}: no ABI fingerprint (built by an older treepack)")
            continue
        abi_fn.restype = ctypes.c_char_p
        abi = abi_fn().decode()
        if abi != _abi.ABI:
            errors.append(f"{path}: built from other ABI tables ({abi}, this package has {_abi.ABI})")
            continue
        return lib
    raise OSError(f"{name} not loaded ({'; '.join(errors)}); build it with `npm run build:cuda` or set {env}")


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_core: Optional[ctypes.CDLL] = None
_cuda: Optional[ctypes.CDLL] = None


def core_library() -> ctypes.CDLL:
    global _core
    if _core is None:
        lib = _library("TREEPACK_CORE_LIB", "libtreepack_core.so")
        lib.tp_loss.argtypes = [ctypes.POINTER(LossConfig), _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P, ctypes.POINTER(LossMetrics)]
        lib.tp_loss.restype = ctypes.c_int
        lib.tp_status_string.restype = ctypes.c_char_p
        _core = lib
    return _core


def cuda_library() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        lib = _library("TREEPACK_CUDA_LIB", "libtreepack_cuda.so")
        lib.tp_cuda_loss.argtypes = [ctypes.POINTER(LossConfig), _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P, ctypes.POINTER(LossMetrics), _P]
        lib.tp_cuda_loss.restype = ctypes.c_int
        lib.tp_cuda_error_string.restype = ctypes.c_char_p
        lib.tp_cuda_last_error.restype = ctypes.c_int
        _cuda = lib
    return _cuda


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
        raise ValueError("seq_offsets, seq_positions and loss_mask disagree on M")
    if M and (pos.min() < 0 or pos.max() >= N):
        raise ValueError(f"logprobs has {N} elements but seq_positions indexes up to {pos.max()}")
    arrays = {}
    for f in _FIELDS:
        a = get(f)
        if a is None:
            if _needed(cfg, f):
                raise ValueError(f"the loss config needs {f} but the batch has none")
            arrays[f] = None
            continue
        arrays[f] = np.ascontiguousarray(a, dtype=np.float32)
        if arrays[f].shape[0] != M:
            raise ValueError(f"{f} has {arrays[f].shape[0]} elements, expected M = {M}")
    trainable = mask != 0
    for name, a in (("logprobs", lp[pos]), *((f, arrays[f]) for f in _FIELDS if arrays[f] is not None and _needed(cfg, f))):
        if not np.isfinite(a[trainable]).all():
            raise ValueError(f"{name} has a non-finite value at a trainable position")
    grad = np.zeros(N, dtype=np.float32)
    metrics = LossMetrics()
    ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
    lib = core_library()
    rc = lib.tp_loss(ctypes.byref(cfg), off.shape[0] - 1, ptr(off), M, ptr(pos), ptr(mask), *(ptr(arrays[f]) for f in _FIELDS), N, ptr(lp), ptr(grad), ctypes.byref(metrics))
    if rc != 0:
        raise ValueError(f"tp_loss: {status_message(rc)}")
    return metrics.loss, grad, metrics.as_dict()


def _torch_function():
    import torch

    class PackedLoss(torch.autograd.Function):
        """loss = PackedLoss.apply(lp, batch, config): lp a float32 tensor [N] (CPU or CUDA, requires_grad), batch a
        mapping of the contract's tensors on the same device. Backward returns grad_output · dloss/dlp, computed in
        the forward pass by the same kernel. ``PackedLoss.last_metrics`` holds the metrics of the latest call."""

        last_metrics: Dict[str, float] = {}

        @staticmethod
        def forward(ctx, lp, batch, config=None):
            if lp.is_cuda:
                cfg = make_config(config)
                t = {k: batch[k].contiguous() for k in ("seq_offsets", "seq_positions", "loss_mask")}
                fields = {f: (batch[f].contiguous() if batch.get(f) is not None and _needed(cfg, f) else None) for f in _FIELDS}
                lp_c = lp.detach().contiguous()
                grad = torch.zeros_like(lp_c)
                metrics = LossMetrics()
                ptr = lambda a: None if a is None else a.data_ptr()  # noqa: E731
                lib = cuda_library()
                rc = lib.tp_cuda_loss(ctypes.byref(cfg), t["seq_offsets"].numel() - 1, ptr(t["seq_offsets"]), t["seq_positions"].numel(),
                                      ptr(t["seq_positions"]), ptr(t["loss_mask"]), *(ptr(fields[f]) for f in _FIELDS), lp_c.numel(),
                                      ptr(lp_c), ptr(grad), ctypes.byref(metrics), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                if rc != 0:
                    cuda = lib.tp_cuda_last_error()
                    detail = f" (CUDA error {cuda}: {lib.tp_cuda_error_string(cuda).decode()})" if rc == _abi.TP_ERR_DEVICE else ""
                    raise RuntimeError(f"tp_cuda_loss: {status_message(rc)}{detail}")
                value, m = metrics.loss, metrics.as_dict()
            else:
                arrays = {k: (v.detach().cpu().numpy() if v is not None else None) for k, v in batch.items()}
                value, g, m = loss_numpy(arrays, lp.detach().cpu().numpy(), config)
                grad = torch.from_numpy(g)
            PackedLoss.last_metrics = m
            ctx.save_for_backward(grad)
            return torch.tensor(value, dtype=torch.float64, device=lp.device)

        @staticmethod
        def backward(ctx, grad_output):
            (grad,) = ctx.saved_tensors
            return (grad_output.to(grad.dtype) * grad, None, None)

    return PackedLoss


def __getattr__(name: str):
    # torch is imported only when PackedLoss is asked for: numpy users need no torch.
    if name == "PackedLoss":
        return _torch_function()
    raise AttributeError(name)
