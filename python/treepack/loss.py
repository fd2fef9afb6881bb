"""The RL loss of a packed micro-batch from Python, through treepack's C ABI (ctypes, no Node).

CPU: ``libtreepack_core.so`` (``tp_loss``), CUDA: ``libtreepack_cuda.so`` (``tp_cuda_loss`` on device pointers);
where each is found: treepack/_native.py.

    >>> import numpy as np, treepack
    >>> from treepack.loss import LossConfig, loss_numpy
    >>> mb = treepack.pack_sequences([[1, 2, 3], [1, 2, 4]], advantages=[1.0, -0.5],
    ...                              old_logprobs=[[0, -0.5, -0.2], [0, -0.5, -1.3]])
    >>> lp = np.array([0, -0.5, -0.2, -1.3], dtype=np.float32)   # [N], one per node: here old_logprobs, ratio 1
    >>> loss, grad, metrics = loss_numpy(mb, lp, LossConfig(clip_low=0.2, clip_high=0.28))   # numpy arrays
    >>> loss, grad.tolist()         # token-mean: -(1 + 1 - 0.5 - 0.5) / 4; node 1 holds token 1 of both sequences
    (-0.25, [0.0, -0.125, -0.25, 0.125])
    >>> metrics["trainable_tokens"], metrics["ratio_mean"], metrics["clipfrac_high"]
    (4, 1.0, 0.0)
    >>> loss_numpy(mb, lp, {"clip_low": 0.2, "clip_high": 0.28})[0]      # the same, as a dict
    -0.25

``treepack.torch.packed_loss(lp, batch, config)`` (and ``treepack.torch.PackedLoss``) is the same loss written in torch
(autograd, any device); ``treepack.torch.loss_kernels.kernel_loss`` runs these kernels, ``tp_cuda_loss`` included, on torch tensors.

Config names, defaults, semantics and validation are those of src/loss/config.ts (docs/concepts/loss.md); every error is a
TreepackError naming the field. Besides the contract's arrays the batch may carry ``seq_weight`` [S] (a trainer's
per-sequence weight, docs/concepts/loss.md, "Aggregation and weights"); the turn aggregation reads ``turn_ids`` [M].
Names, defaults, enum codes, status codes and struct layouts come from _abi.py, generated from the same table as the
C header (src/backend/abi.ts); a library built from other tables is refused.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _abi, _native
from ._native import status_message
from .errors import TreepackError

POLICIES = _abi.POLICY_NAMES
AGGREGATIONS = _abi.AGGREGATION_NAMES
KL_ESTIMATORS = _abi.KL_NAMES
TIS_LEVELS = _abi.TIS_NAMES
DEFAULTS: dict[str, Any] = dict(_abi.DEFAULTS)  # clip_high None: = clip_low


LossConfigStruct = _abi.tp_loss_config  # make_config builds it


class LossMetrics(_abi.tp_loss_metrics):
    """``tp_loss_metrics`` of the C ABI, read back as a dict."""

    def as_dict(self) -> dict[str, float]:
        return {n: getattr(self, n) for n, *_ in self._fields_}


# The table's defaults are of mixed types; each field below declares its own, which __post_init__ checks.
_DEFAULTS: Mapping[str, Any] = _abi.DEFAULTS


@dataclass
class LossConfig:
    """The loss configuration as a typed object: the same names, defaults and checks as the dict form (both are
    accepted wherever a config is). Invalid values raise TreepackError(E_ARG) naming the field when constructed.

        >>> cfg = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="seq-mean-token-mean", loss_scale=8)
        >>> cfg.kl, cfg.tis                  # the defaults of the fields not given
        ('none', 'none')
        >>> LossConfig(clip_low=-1)
        Traceback (most recent call last):
        treepack.errors.TreepackError: field "clip_low": Expected a number >= 0 for clip_low but received -1
    """

    policy: str = field(
        default=_DEFAULTS["policy"],
        metadata={
            "help": (
                "'ppo': clipped ratio (asymmetric clip, optional dual clip); 'gspo': sequence-level ratio; "
                "'cispo': clipped, detached IS weight times lp."
            )
        },
    )
    clip_low: float = field(
        default=_DEFAULTS["clip_low"], metadata={"help": "ε_low >= 0: the ratio is clipped to [1 - clip_low, 1 + clip_high]."}
    )
    clip_high: float | None = field(default=_DEFAULTS["clip_high"], metadata={"help": "ε_high >= 0; None: equal to clip_low."})
    dual_clip: float = field(
        default=_DEFAULTS["dual_clip"], metadata={"help": "Dual-clip constant c > 1 for negative advantages (ppo only); 0 = off."}
    )
    log_ratio_clamp: float = field(
        default=_DEFAULTS["log_ratio_clamp"],
        metadata={"help": "|lp - old| (and every other log ratio) is clamped to this before exp; > 0."},
    )
    aggregation: str = field(
        default=_DEFAULTS["aggregation"],
        metadata={
            "help": (
                "'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm' or 'seq-mean-turn-mean-token-mean' "
                "(Flow-GRPO: each turn's token mean, averaged over the sequence's turns, then over sequences; reads turn_ids)."
            )
        },
    )
    norm_constant: float = field(
        default=_DEFAULTS["norm_constant"], metadata={"help": "The fixed divisor of 'seq-mean-token-sum-norm' (> 0 there)."}
    )
    global_tokens: float = field(
        default=_DEFAULTS["global_tokens"],
        metadata={"help": "T of token-mean across the global batch; 0 = this micro-batch's trainable tokens."},
    )
    global_sequences: float = field(
        default=_DEFAULTS["global_sequences"],
        metadata={"help": "G of the seq-mean modes across the global batch; 0 = this micro-batch's sequences with a trainable token."},
    )
    loss_scale: float = field(
        default=_DEFAULTS["loss_scale"],
        metadata={"help": "Multiplies loss, pg_loss, kl_loss and the gradient (verl's and AReaL's x dp); >= 0."},
    )
    kl: str = field(default=_DEFAULTS["kl"], metadata={"help": "KL to ref_logprobs as a loss term: 'none', 'k1', 'abs', 'k2' or 'k3'."})
    kl_coef: float = field(default=_DEFAULTS["kl_coef"], metadata={"help": "Coefficient of the KL term (any finite number)."})
    tis: str = field(
        default=_DEFAULTS["tis"],
        metadata={
            "help": "Truncated importance weights min(exp(old - rollout), tis_cap) from rollout_logprobs: 'none', 'token' or 'sequence'."
        },
    )
    tis_cap: float = field(default=_DEFAULTS["tis_cap"], metadata={"help": "The truncation cap of tis; > 0."})

    def __post_init__(self) -> None:
        given = dataclasses.asdict(self)
        if given["clip_high"] is None:  # None is the dataclass's "not given"
            del given["clip_high"]
        for k, v in _resolve(given).items():
            setattr(self, k, v)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict of its fields (JSON-serialisable; what `treepack loss --config` reads)."""
        return dataclasses.asdict(self)


def _resolve(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults filled and every field checked as src/loss/config.ts checks it (TreepackError E_ARG naming the field)."""
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

    for name, table in (("policy", POLICIES), ("aggregation", AGGREGATIONS), ("kl", KL_ESTIMATORS), ("tis", TIS_LEVELS)):
        if not isinstance(c[name], str) or c[name] not in table:
            raise bad(name, f"one of {', '.join(table)}")
    for name, ok, expected in (
        ("clip_low", lambda x: x >= 0, "a number >= 0"),
        ("clip_high", lambda x: x >= 0, "a number >= 0"),
        ("dual_clip", lambda x: x == 0 or x > 1, "a number > 1 (or 0 for no dual clip)"),
        ("log_ratio_clamp", lambda x: x > 0, "a number > 0"),
        ("norm_constant", lambda x: x >= 0, "a number > 0"),
        ("global_tokens", lambda x: x >= 0, "a number >= 0 (0 = this micro-batch)"),
        ("global_sequences", lambda x: x >= 0, "a number >= 0 (0 = this micro-batch)"),
        ("loss_scale", lambda x: x >= 0, "a number >= 0"),
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
    return c


def resolve_config(config: None | Mapping[str, Any] | LossConfig = None) -> dict[str, Any]:
    """The config (a ``LossConfig``, a dict of the same names, or None for the defaults) as a dict with the defaults
    filled and every field checked (TreepackError naming the field): resolve once and pass the dict when compiling,
    so the compiled code holds only constants."""
    return _resolve(config.to_dict() if isinstance(config, LossConfig) else config)


def make_config(config: None | Mapping[str, Any] | LossConfig = None) -> LossConfigStruct:
    """The C ABI's struct of a config (a ``LossConfig``, a dict of the same names, or None for the defaults)."""
    c = resolve_config(config)
    codes = {
        name: table.index(c[name])
        for name, table in (("policy", POLICIES), ("aggregation", AGGREGATIONS), ("kl", KL_ESTIMATORS), ("tis", TIS_LEVELS))
    }
    return LossConfigStruct(**codes, **{k: float(c[k]) for k in _abi.NUMBER_FIELDS})


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


def _needed(c: Mapping[str, Any], name: str) -> bool:
    """Whether the resolved config ``c`` reads the per-occurrence field ``name``."""
    return (
        name in ("advantages", "old_logprobs")
        or (name == "ref_logprobs" and c["kl"] != "none")
        or (name == "rollout_logprobs" and c["tis"] != "none")
    )


def _turns(c: Mapping[str, Any]) -> bool:
    """Whether the resolved config ``c`` aggregates per turn (reads turn_ids)."""
    return bool(c["aggregation"] == "seq-mean-turn-mean-token-mean")


def _status_field(rc: int) -> str:
    """The input a failed loss call's status is about."""
    return {_abi.TP_ERR_INDEX: "seq_positions", _abi.TP_ERR_TURNS: "turn_ids"}.get(rc, "seq_offsets")


def _check_weights(sw: np.ndarray | None, S: int) -> None:
    """seq_weight: one finite weight >= 0 per sequence (the kernels take it as it is)."""
    if sw is None:
        return
    if sw.shape != (S,):
        raise TreepackError(
            "E_INPUT", f"seq_weight has shape {list(sw.shape)}, expected one weight per sequence [S = {S}]", field="seq_weight"
        )
    if not (np.isfinite(sw) & (sw >= 0)).all():
        raise TreepackError(
            "E_INPUT",
            f"seq_weight[{int(np.flatnonzero(~(np.isfinite(sw) & (sw >= 0)))[0])}] is not a finite number >= 0",
            field="seq_weight",
        )


def loss_numpy(
    batch: Any, lp: np.ndarray, config: None | Mapping[str, Any] | LossConfig = None
) -> tuple[float, np.ndarray, dict[str, float]]:
    """Loss, dloss/dlp [N] (float32) and metrics on the CPU core. ``batch`` is a treepack.MicroBatch or a mapping
    with the contract's arrays (seq_offsets, seq_positions, loss_mask, advantages, old/ref/rollout logprobs,
    turn_ids) and optionally ``seq_weight`` [S]."""

    def get(k: str) -> Any:
        return batch.get(k) if isinstance(batch, Mapping) else getattr(batch, k, None)

    c = resolve_config(config)
    cfg = make_config(c)
    off = np.ascontiguousarray(get("seq_offsets"), dtype=np.int32)
    pos = np.ascontiguousarray(get("seq_positions"), dtype=np.int32)
    mask = np.ascontiguousarray(get("loss_mask"), dtype=np.uint8)
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    M, N = pos.shape[0], lp.shape[0]
    if off.shape[0] < 1 or off[-1] != M or mask.shape[0] != M:
        raise TreepackError(
            "E_INPUT",
            f"seq_offsets ends at {off[-1] if off.shape[0] else None} and loss_mask has {mask.shape[0]} elements, "
            f"but seq_positions has M = {M}",
            field="seq_offsets" if mask.shape[0] == M else "loss_mask",
        )
    if M and (pos.min() < 0 or pos.max() >= N):
        raise TreepackError(
            "E_INPUT",
            f"logprobs has {N} elements but seq_positions holds {pos.min() if pos.min() < 0 else pos.max()}",
            field="seq_positions" if pos.min() < 0 else "logprobs",
        )
    arrays: dict[str, np.ndarray | None] = {}
    for f in _FIELDS:
        a = get(f)
        if a is None:
            if _needed(c, f):
                raise TreepackError("E_INPUT", f"the loss config needs {f} but the batch has none", field=f)
            arrays[f] = None
            continue
        arr = np.ascontiguousarray(a, dtype=np.float32)
        if arr.shape[0] != M:
            raise TreepackError("E_INPUT", f"{f} has {arr.shape[0]} elements, expected M = {M}", field=f)
        arrays[f] = arr
    sw = get("seq_weight")
    sw = None if sw is None else np.ascontiguousarray(sw, dtype=np.float32)
    _check_weights(sw, off.shape[0] - 1)
    turn = get("turn_ids") if _turns(c) else None
    if _turns(c) and (turn is not None or M):
        if turn is None:
            raise TreepackError(
                "E_INPUT", "aggregation 'seq-mean-turn-mean-token-mean' needs turn_ids but the batch has none", field="turn_ids"
            )
        turn = np.ascontiguousarray(turn, dtype=np.int32)
        if turn.shape != (M,):
            raise TreepackError("E_INPUT", f"turn_ids has shape {list(turn.shape)}, expected [M = {M}]", field="turn_ids")
    trainable = mask != 0
    for name, a in (("logprobs", lp[pos]), *((f, a) for f, a in arrays.items() if a is not None and _needed(c, f))):
        if not np.isfinite(a[trainable]).all():
            raise TreepackError("E_INPUT", f"{name} has a non-finite value at a trainable position", field=name)
    grad = np.zeros(N, dtype=np.float32)
    metrics = LossMetrics()
    ptr = _native.pointer
    lib = core_library()
    rc = lib.tp_loss(
        ctypes.byref(cfg),
        off.shape[0] - 1,
        ptr(off),
        M,
        ptr(pos),
        ptr(mask),
        *(ptr(arrays[f]) for f in _FIELDS),
        ptr(sw),
        ptr(turn),
        N,
        ptr(lp),
        ptr(grad),
        ctypes.byref(metrics),
    )
    if rc != 0:
        raise TreepackError(
            _abi.STATUSES[rc][2] if 0 < rc < len(_abi.STATUSES) else "E_BACKEND", f"tp_loss: {status_message(rc)}", field=_status_field(rc)
        )
    return metrics.loss, grad, metrics.as_dict()
