"""The per-occurrence formulas of the RL loss as torch expressions (native/core/loss_math.h; src/loss/policy.ts, kl.ts).

Written so that autograd's derivative is exactly the one the C and CUDA kernels compute by hand: a clamp passes the
derivative on its closed interval and 0 outside, a clipped branch is a detached constant (derivative 0), and every
branch is a ``torch.where`` on the kernels' own condition, so ties fall the same way. Inputs are float64 tensors of
one shape (masked positions already replaced by finite values); ``c`` is a resolved config dict (treepack.loss).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _abi

Tensor = torch.Tensor


def _clamp_keep(x: Tensor, lo: float, hi: float) -> Tensor:
    """clamp(x, lo, hi) whose derivative is 1 on [lo, hi] (both ends included) and 0 outside, as the kernels'."""
    return torch.where((x >= lo) & (x <= hi), x, x.clamp(lo, hi).detach())


def clamped_ratio(log_ratio: Tensor, c: Mapping[str, Any]) -> Tensor:
    """r = exp(clamp(log_ratio, ±log_ratio_clamp))."""
    C = c["log_ratio_clamp"]
    return torch.exp(_clamp_keep(log_ratio, -C, C))


def clipped_surrogate(log_ratio: Tensor, A: Tensor, c: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """ppo / gspo: max(−A·r, −A·clip(r)), then for A < 0 min(·, −A·dual_clip) when dual_clip > 0.
    Returns (value, r detached, clipped high, clipped low, dual clipped)."""
    r = clamped_ratio(log_ratio, c)
    rd = r.detach()
    l1 = -A * r
    l2 = -A * rd.clamp(1 - c["clip_low"], 1 + c["clip_high"])
    clipped = l2 > l1
    value = torch.where(clipped, l2, l1)
    high, low = clipped & (A > 0), clipped & ~(A > 0)
    if c["dual_clip"] > 0:
        cap = -A * c["dual_clip"]
        dual = (A < 0) & (value.detach() > cap)
        value = torch.where(dual, cap, value)
    else:
        dual = torch.zeros_like(clipped)
    return value, rd, high, low, dual


def cispo(lp: Tensor, old: Tensor, A: Tensor, c: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """−sg(clip(r))·A·lp. Returns (value, r detached, r above the clip, r below it)."""
    r = clamped_ratio(lp.detach() - old, c)
    lo, hi = 1 - c["clip_low"], 1 + c["clip_high"]
    return -r.clamp(lo, hi) * A * lp, r, r > hi, r < lo


def truncated_weight(log_w: Tensor, c: Mapping[str, Any]) -> Tensor:
    """min(exp(clamp(log_w, ±log_ratio_clamp)), tis_cap): the truncated importance weight (no gradient: no lp in it)."""
    return clamped_ratio(log_w, c).clamp(max=c["tis_cap"])


def kl_term(kind: str, lp: Tensor, ref: Tensor) -> Tensor:
    """The KL estimator of lp against ref per occurrence ('k1', 'abs', 'k2', 'k3'; k3's log and value clamps)."""
    diff = lp - ref
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()  # derivative sign(diff), 0 at 0 as the kernels'
    if kind == "k2":
        return 0.5 * diff * diff
    x = _clamp_keep(-diff, -_abi.K3_LOG_CLAMP, _abi.K3_LOG_CLAMP)
    return _clamp_keep(torch.exp(x) - x - 1, -_abi.K3_VALUE_CLAMP, _abi.K3_VALUE_CLAMP)


def turn_runs(offsets: Tensor, seq: Tensor, turn: Tensor) -> tuple[Tensor, Tensor]:
    """The turns of turn-level aggregation: each run of equal turn ids within a sequence is one. (run [M]: each
    occurrence's turn, numbered over the batch; run_seq [M]: turn r's sequence, for r < the number of turns, 0 after)."""
    j = torch.arange(seq.shape[0], device=seq.device)
    start = (j == offsets[:-1][seq]) | (turn != torch.cat([turn[:1], turn[:-1]]))
    run = torch.cumsum(start.long(), 0) - 1
    return run, torch.zeros_like(run).scatter_(0, run, seq)
