"""The packed RL loss as a torch autograd Function over treepack's C ABI.

    >>> import torch, treepack
    >>> from treepack.torch import from_microbatch
    >>> batch = from_microbatch(treepack.pack_sequences([[1, 2, 3], [1, 2, 4]], advantages=[1.0, -0.5],
    ...                                                 old_logprobs=[[0, -0.5, -0.2], [0, -0.5, -1.3]]))
    >>> lp = torch.tensor([0, -0.5, -0.2, -1.3], requires_grad=True)                  # [N]: old_logprobs, ratio 1
    >>> loss, metrics = packed_loss(lp, batch, {"clip_low": 0.2, "clip_high": 0.28})   # metrics: dict of floats
    >>> loss.backward()
    >>> loss.item(), lp.grad.tolist()      # lp.grad = dloss/dlp [N]: -(1 + 1 - 0.5 - 0.5) / 4; node 1 is in both
    (-0.25, [0.0, -0.125, -0.25, 0.125])

CPU tensors run ``tp_loss`` (libtreepack_core.so); CUDA tensors run ``tp_cuda_loss`` on their device pointers, on
the tensors' own device and that device's current stream. The kernels compute the gradient with the loss, so
backward is a scale. Precision: lp and the per-occurrence floats are float32 at the kernels (a float64 ``lp`` is
rounded to float32, its gradient returned in float64); sums accumulate in float64 on CPU. Against a float64
reference the loss and gradient agree to about 1e-6 relative.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from ..loss import _FIELDS, LossConfig, LossMetrics, _check_weights, _needed, _turns, cuda_library, cuda_status_error, loss_numpy, make_config
from ..microbatch import TreepackError
from .batch import PackedBatch

METRICS = tuple(name for name, _ in LossMetrics._fields_)


def _get(batch: Union[PackedBatch, Mapping[str, Any]], name: str) -> Any:
    return batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)


def _tensors(lp: torch.Tensor, batch: Union[PackedBatch, Mapping[str, Any]], cfg: Any) -> Dict[str, Optional[torch.Tensor]]:
    """The kernel's inputs, checked as the CPU core checks them (and for device), as contiguous tensors on lp's
    device in the C ABI's dtypes."""

    def bad(name: str, message: str) -> TreepackError:
        return TreepackError("E_INPUT", message, field=name)

    if not isinstance(lp, torch.Tensor) or lp.dim() != 1 or not lp.is_floating_point():
        raise bad("logprobs", f"expected a 1-D floating tensor [N], got {getattr(lp, 'dtype', type(lp).__name__)} {list(getattr(lp, 'shape', []))}")
    N = lp.shape[0]
    if isinstance(batch, PackedBatch) and batch.num_nodes != N:
        raise bad("logprobs", f"logprobs has {N} elements but the batch has N = {batch.num_nodes} nodes")
    out: Dict[str, Optional[torch.Tensor]] = {}
    kinds = {"seq_offsets": "index", "seq_positions": "index", "loss_mask": "mask", **{f: "float" for f in _FIELDS + ("seq_weight",)}, "turn_ids": "index"}
    optional = {"seq_weight": True, "turn_ids": True, **{f: not _needed(cfg, f) for f in _FIELDS}}
    for name, kind in kinds.items():
        t = _get(batch, name)
        if t is None:
            if not optional.get(name, False):
                raise bad(name, f"the {'loss config needs' if name in optional else 'batch needs'} {name} but the batch has none")
            out[name] = None
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise bad(name, f"expected a 1-D tensor, got {type(t).__name__} {list(getattr(t, 'shape', []))}")
        if t.device != lp.device:
            raise bad(name, f"{name} is on {t.device} but logprobs is on {lp.device}")
        ok = {"index": (torch.int32, torch.int64), "mask": (torch.bool, torch.uint8), "float": (torch.float32, torch.float64)}[kind]
        if t.dtype not in ok:
            raise bad(name, f"{name} has dtype {t.dtype}, expected one of {', '.join(str(d) for d in ok)}")
        out[name] = t
    off, pos, mask = out["seq_offsets"], out["seq_positions"], out["loss_mask"]
    M = pos.shape[0]
    if off.shape[0] < 1 or int(off[0]) != 0 or int(off[-1]) != M or bool((off[1:] < off[:-1]).any()):
        raise bad("seq_offsets", f"seq_offsets is not CSR offsets of M = {M} occurrences (starts at 0, never decreases, ends at M)")
    if _turns(cfg) and M and out["turn_ids"] is None:
        raise bad("turn_ids", "the loss config needs turn_ids but the batch has none")
    for name in ("loss_mask", "turn_ids") + _FIELDS:
        t = out[name]
        if t is not None and t.shape[0] != M:
            raise bad(name, f"{name} has {t.shape[0]} elements, expected M = {M}")
    if out["seq_weight"] is not None:
        _check_weights(out["seq_weight"].detach().cpu().numpy(), off.shape[0] - 1)
    if M and (int(pos.min()) < 0 or int(pos.max()) >= N):
        raise bad("seq_positions", f"seq_positions holds {int(pos.min()) if int(pos.min()) < 0 else int(pos.max())}, outside [0, N = {N})")
    if max(N, M) > 2**31 - 1:
        raise bad("seq_positions", f"N = {N}, M = {M}: the kernels index with int32")
    train = mask.bool()
    for name, t in (("logprobs", lp[pos]),) + tuple((f, out[f]) for f in _FIELDS if out[f] is not None and _needed(cfg, f)):
        if not bool(torch.isfinite(t[train]).all()):
            raise bad(name, f"{name} has a non-finite value at a trainable position")
    res = {"seq_offsets": off.to(torch.int32).contiguous(), "seq_positions": pos.to(torch.int32).contiguous(), "loss_mask": mask.to(torch.uint8).contiguous()}
    for f in _FIELDS:
        res[f] = out[f].to(torch.float32).contiguous() if out[f] is not None and _needed(cfg, f) else None
    res["seq_weight"] = None if out["seq_weight"] is None else out["seq_weight"].to(torch.float32).contiguous()
    res["turn_ids"] = out["turn_ids"].to(torch.int32).contiguous() if out["turn_ids"] is not None and _turns(cfg) else None
    res["lp"] = lp.detach().to(torch.float32).contiguous()
    return res


def _run_cuda(cfg: Any, t: Dict[str, Optional[torch.Tensor]]) -> Tuple[float, torch.Tensor, Dict[str, float]]:
    lp = t["lp"]
    assert lp is not None
    grad = torch.zeros_like(lp)
    metrics = LossMetrics()
    ptr = lambda a: None if a is None else a.data_ptr()  # noqa: E731
    lib = cuda_library()
    with torch.cuda.device(lp.device):
        stream = torch.cuda.current_stream(lp.device)
        off, pos = t["seq_offsets"], t["seq_positions"]
        rc = lib.tp_cuda_loss(ctypes.byref(cfg), off.numel() - 1, ptr(off), pos.numel(), ptr(pos), ptr(t["loss_mask"]),
                              *(ptr(t[f]) for f in _FIELDS), ptr(t["seq_weight"]), ptr(t["turn_ids"]), lp.numel(), ptr(lp),
                              ptr(grad), ctypes.byref(metrics),
                              ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise cuda_status_error(lib, "tp_cuda_loss", rc)
    return metrics.loss, grad, metrics.as_dict()


class PackedLoss(torch.autograd.Function):
    """``loss, metrics = PackedLoss.apply(lp, batch, config)``: lp [N] (requires_grad) on CPU or CUDA, batch a
    ``PackedBatch`` or a mapping of the contract's tensors on lp's device (a mapping may add ``seq_weight`` [S]),
    config a ``LossConfig`` or a dict as in docs/concepts/loss.md. loss is a float64 scalar on lp's device; metrics a float64
    CPU tensor in ``METRICS`` order (``packed_loss`` gives a dict)."""

    @staticmethod
    def forward(ctx: Any, lp: torch.Tensor, batch: Any, config: Union[None, Mapping[str, Any], LossConfig] = None) -> Tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        cfg = make_config(config)
        t = _tensors(lp, batch, cfg)
        if lp.is_cuda:
            value, grad, m = _run_cuda(cfg, t)
        else:
            arrays = {k: (None if v is None else v.numpy()) for k, v in t.items() if k != "lp"}
            lp_np = t["lp"].numpy()  # type: ignore[union-attr]
            value, g, m = loss_numpy(arrays, lp_np, config)
            grad = torch.from_numpy(g)
        ctx.save_for_backward(grad.to(lp.dtype))
        metrics = torch.tensor([float(m[k]) for k in METRICS], dtype=torch.float64)
        ctx.mark_non_differentiable(metrics)
        return torch.tensor(value, dtype=torch.float64, device=lp.device), metrics

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_metrics: Any) -> Tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad_loss.to(grad.dtype) * grad, None, None


def packed_loss(lp: torch.Tensor, batch: Union[PackedBatch, Mapping[str, Any]], config: Union[None, Mapping[str, Any], LossConfig] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The loss (differentiable w.r.t. lp) and its metrics (docs/concepts/loss.md: loss, pg_loss, kl_loss, clip fractions,
    approx_kl, ratio stats, trainable_tokens) as a dict."""
    loss, metrics = PackedLoss.apply(lp, batch, config)
    values = dict(zip(METRICS, metrics.tolist()))
    values["trainable_tokens"] = int(values["trainable_tokens"])
    return loss, values


__all__ = ["METRICS", "PackedLoss", "packed_loss"]
