"""The loss kernels of the C ABI on torch tensors: the test oracles of ``treepack.torch.packed_loss``.

``kernel_loss(lp, batch, config, kernel=...)`` runs ``tp_loss`` (the C core, CPU tensors), ``tp_cuda_loss`` (the CUDA
library on CUDA tensors' device pointers, on the current stream, which it synchronises) or ``tp_cuda_loss_host``
(the CUDA library from host tensors: it copies them to its device; an emulated build runs it on the CPU). Inputs are
checked as ``packed_loss`` checks them, then rounded to the C ABI's types (float32 lp and fields, int32 indices): the
kernels compute in double and return a float32 gradient. Returns (loss, dloss/dlp float32 [N] on lp's device, metrics).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .._native import device_pointer
from ..loss import _FIELDS, LossMetrics, cuda_library, cuda_status_error, loss_numpy, make_config
from .loss import Batch, Config, loss_inputs, resolve_config

KERNELS = ("auto", "core", "cuda", "cuda-host")


def kernel_loss(
    lp: torch.Tensor, batch: Batch, config: Config = None, *, kernel: str = "auto"
) -> tuple[float, torch.Tensor, dict[str, float]]:
    """(loss, float32 gradient [N] on lp's device, metrics dict) from one of the C ABI's kernels (``KERNELS``; "auto":
    the core for CPU tensors, tp_cuda_loss for CUDA ones)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = "cuda" if lp.is_cuda else "core"
    t = loss_inputs(lp, batch, resolve_config(config), validate=True)
    c_types = {"seq_offsets": torch.int32, "seq_positions": torch.int32, "loss_mask": torch.uint8, "turn_ids": torch.int32}
    a = {k: None if v is None else v.to(c_types.get(k, torch.float32)).contiguous() for k, v in t.items()}
    x = lp.detach().to(torch.float32).contiguous()
    if kernel == "core":
        value, g, m = loss_numpy({k: None if v is None else v.cpu().numpy() for k, v in a.items()}, x.cpu().numpy(), config)
        return value, torch.from_numpy(g).to(lp.device), m
    if kernel == "cuda-host":
        a, x = {k: None if v is None else v.cpu() for k, v in a.items()}, x.cpu()
    grad = torch.zeros_like(x)
    metrics = LossMetrics()
    c_of = {torch.int32: ctypes.c_int32, torch.uint8: ctypes.c_uint8, torch.float32: ctypes.c_float}

    def ptr(v: torch.Tensor | None) -> Any:
        return None if v is None else device_pointer(v.data_ptr(), c_of[v.dtype])

    lib = cuda_library()
    off, pos = a["seq_offsets"], a["seq_positions"]
    assert off is not None and pos is not None
    args = (
        ctypes.byref(make_config(config)),
        off.numel() - 1,
        ptr(off),
        pos.numel(),
        ptr(pos),
        ptr(a["loss_mask"]),
        *(ptr(a[f]) for f in _FIELDS),
        ptr(a["seq_weight"]),
        ptr(a["turn_ids"]),
        x.numel(),
        ptr(x),
        ptr(grad),
        ctypes.byref(metrics),
    )
    if kernel == "cuda-host":
        rc, name = lib.tp_cuda_loss_host(*args), "tp_cuda_loss_host"
    else:
        with torch.cuda.device(x.device):
            rc, name = lib.tp_cuda_loss(*args, ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)), "tp_cuda_loss"
    if rc != 0:
        raise cuda_status_error(lib, name, rc)
    return metrics.loss, grad.to(lp.device), metrics.as_dict()


__all__ = ["KERNELS", "kernel_loss"]
