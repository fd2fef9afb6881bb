"""The packed RL loss in torch, under autograd, on lp's device: the formulas of docs/concepts/loss.md as tensor ops.

    >>> import torch, treepack
    >>> from treepack.torch import from_microbatch
    >>> batch = from_microbatch(treepack.pack_sequences([[1, 2, 3], [1, 2, 4]], advantages=[1.0, -0.5],
    ...                                                 old_logprobs=[[0, -0.5, -0.2], [0, -0.5, -1.3]]))
    >>> lp = torch.tensor([0, -0.5, -0.2, -1.3], requires_grad=True)                  # [N]: old_logprobs, ratio 1
    >>> loss, metrics = packed_loss(lp, batch, {"clip_low": 0.2, "clip_high": 0.28})   # metrics: dict of floats
    >>> loss.backward()
    >>> loss.item(), lp.grad.tolist()      # lp.grad = dloss/dlp [N]: -(1 + 1 - 0.5 - 0.5) / 4; node 1 is in both
    (-0.25, [0.0, -0.125, -0.25, 0.125])
    >>> loss, metrics = packed_loss(lp, batch, {"clip_low": 0.2}, validate=False, metrics="tensor")   # no host sync
    >>> metrics["trainable_tokens"]        # 0-d float64 tensors on lp's device
    tensor(4., dtype=torch.float64)

The loss is a few dozen tensor ops (gathers, ``index_add`` segment sums, ``torch.where``): the gradient comes from
autograd, nothing leaves the device, and ``packed_loss(..., validate=False, metrics="tensor")`` reads no value on
the host, so it runs on any device, on the current stream, under ``torch.compile(fullgraph=True)`` and in CUDA
graphs. ``validate=True`` (the default) first checks the values as the C core does (CSR offsets, positions in
range, turn ids non-decreasing, finite trainable inputs, seq_weight): those checks copy values to the host (one
sync each); shapes, dtypes and devices are checked from metadata in both modes. ``metrics="float"`` (the default)
converts the metrics with one copy at the end; ``metrics_to_floats`` does that for the tensor form.

Precision: everything is computed in float64 from the inputs as given (a float32 lp or field is widened exactly; a
float64 one stays float64), and lp's gradient is returned in lp's dtype. The C core and the CUDA kernels
(``treepack.torch.loss_kernels``, this loss's test oracles) read float32 and return a float32 gradient: on
float32-representable inputs loss and metrics agree with them to about 1e-15 relative, the gradient to float32
rounding. On CUDA the segment sums (GSPO's sequence ratio, sequence TIS) and the gradient's sum over a node's
occurrences use atomics, so their last bits may vary run to run unless ``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union, cast

import torch

from ..loss import _FIELDS, LossConfig, LossMetrics, _check_weights, _needed, _turns, resolve_config
from ..microbatch import TreepackError
from . import loss_terms as terms
from .batch import PackedBatch
from .moe import RouterOutputs, load_balancing_loss

METRICS = tuple(name for name, *_ in LossMetrics._fields_)

Tensor = torch.Tensor
Config = Union[None, Mapping[str, Any], LossConfig]
Batch = Union[PackedBatch, Mapping[str, Any]]


def _get(batch: Batch, name: str) -> Any:
    return batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)


def _seq_index(batch: Batch) -> Tensor | None:
    """The loader's sequence of each occurrence, when the batch is a PackedBatch (a mapping's is derived)."""
    return batch.seq_index if isinstance(batch, PackedBatch) else None


def _bad(name: str, message: str) -> TreepackError:
    return TreepackError("E_INPUT", message, field=name)


def loss_inputs(lp: Tensor, batch: Batch, c: Mapping[str, Any], validate: bool = True) -> dict[str, Tensor | None]:
    """The batch's tensors the loss reads (None for those the config does not), checked as the C core checks them.
    Presence, shapes, dtypes and devices are read from metadata; with ``validate`` the values too (host copies)."""
    if not isinstance(lp, Tensor) or lp.dim() != 1 or not lp.is_floating_point():
        got = f"{getattr(lp, 'dtype', type(lp).__name__)} {list(getattr(lp, 'shape', []))}"
        raise _bad("logprobs", f"expected a 1-D floating tensor [N], got {got}")
    N = lp.shape[0]
    if isinstance(batch, PackedBatch) and batch.num_nodes != N:
        raise _bad("logprobs", f"logprobs has {N} elements but the batch has N = {batch.num_nodes} nodes")
    kinds = {
        "seq_offsets": "index",
        "seq_positions": "index",
        "loss_mask": "mask",
        **{f: "float" for f in _FIELDS + ("seq_weight",)},
        "turn_ids": "index",
    }
    used = {"seq_weight": True, "turn_ids": _turns(c), **{f: _needed(c, f) for f in _FIELDS}}
    out: dict[str, Tensor | None] = {}
    for name, kind in kinds.items():
        t = _get(batch, name)
        if t is None or not used.get(name, True):
            if name in ("seq_offsets", "seq_positions", "loss_mask") or (name in _FIELDS and used[name]):
                raise _bad(name, f"the {'loss config needs' if name in used else 'batch needs'} {name} but the batch has none")
            out[name] = None
            continue
        if not isinstance(t, Tensor) or t.dim() != 1:
            raise _bad(name, f"expected a 1-D tensor, got {type(t).__name__} {list(getattr(t, 'shape', []))}")
        if t.device != lp.device:
            raise _bad(name, f"{name} is on {t.device} but logprobs is on {lp.device}")
        ok = {"index": (torch.int32, torch.int64), "mask": (torch.bool, torch.uint8), "float": (torch.float32, torch.float64)}[kind]
        if t.dtype not in ok:
            raise _bad(name, f"{name} has dtype {t.dtype}, expected one of {', '.join(str(d) for d in ok)}")
        out[name] = t
    off, pos = out["seq_offsets"], out["seq_positions"]
    assert off is not None and pos is not None
    S, M = off.shape[0] - 1, pos.shape[0]
    if S < 0:
        raise _bad("seq_offsets", "seq_offsets is empty; expected S + 1 CSR offsets")
    if _turns(c) and M and out["turn_ids"] is None:
        raise _bad("turn_ids", "aggregation 'seq-mean-turn-mean-token-mean' needs turn_ids but the batch has none")
    for name in ("loss_mask", "turn_ids") + _FIELDS:
        t = out[name]
        if t is not None and t.shape[0] != M:
            raise _bad(name, f"{name} has {t.shape[0]} elements, expected M = {M}")
    sw = out["seq_weight"]
    if sw is not None and sw.shape[0] != S:
        raise _bad("seq_weight", f"seq_weight has shape {list(sw.shape)}, expected one weight per sequence [S = {S}]")
    if validate:
        _check_values(lp, out)
    return out


def _check_values(lp: Tensor, t: dict[str, Tensor | None]) -> None:
    """The value checks of tp_loss, in its order, on host copies (each reads device memory: a sync)."""
    off, pos, mask = t["seq_offsets"].cpu(), t["seq_positions"].cpu(), t["loss_mask"].cpu().bool()  # type: ignore[union-attr]
    N, M = lp.shape[0], pos.shape[0]
    if int(off[0]) != 0 or int(off[-1]) != M or bool((off[1:] < off[:-1]).any()):
        raise _bad("seq_offsets", f"seq_offsets is not CSR offsets of M = {M} occurrences (starts at 0, never decreases, ends at M)")
    if M and (int(pos.min()) < 0 or int(pos.max()) >= N):
        raise _bad("seq_positions", f"seq_positions holds {int(pos.min()) if int(pos.min()) < 0 else int(pos.max())}, outside [0, N = {N})")
    turn = t["turn_ids"]
    if turn is not None and M > 1:
        turn = turn.cpu()
        starts = torch.zeros(M, dtype=torch.bool)
        starts[off[:-1][off[:-1] < M].long()] = True
        if bool(((turn[1:] < turn[:-1]) & ~starts[1:]).any()):
            raise _bad("turn_ids", "turn_ids decrease within a sequence (each sequence's turns are numbered in order)")
    sw = t["seq_weight"]
    if sw is not None:
        _check_weights(sw.cpu().numpy(), off.shape[0] - 1)
    present = tuple((f, x) for f in _FIELDS if (x := t[f]) is not None)
    for name, v in (("logprobs", lp.detach()[cast(Tensor, t["seq_positions"]).long()]), *present):
        if not bool(torch.isfinite(v.cpu()[mask]).all()):
            raise _bad(name, f"{name} has a non-finite value at a trainable position")


def _context_parallel(batch: Batch) -> Any:
    """The LocalPart of a rank's local part of a context-parallel row (treepack.torch.context_parallel), else None."""
    return batch.context_parallel if isinstance(batch, PackedBatch) else None


def _loss(
    lp: Tensor, t: dict[str, Tensor | None], c: Mapping[str, Any], seq_index: Tensor | None, part: Any = None
) -> tuple[Tensor, Tensor]:
    """(loss, metrics [len(METRICS)]) in float64 on lp's device; no host reads, no data-dependent Python. On a
    context-parallel local part (``part``), the per-sequence sums the aggregation reads are all-reduced over the group:
    the loss is the local occurrences' share of the row's, the metrics are the row's."""
    f64 = torch.float64
    off, pos = t["seq_offsets"].long(), t["seq_positions"].long()  # type: ignore[union-attr]
    S, M = off.shape[0] - 1, pos.shape[0]
    dev = lp.device
    m = t["loss_mask"].bool()  # type: ignore[union-attr]
    mf = m.to(f64)
    # The sequence of each occurrence: offsets are CSR, so the count of sequence ends at or before j.
    seq = seq_index if seq_index is not None else torch.searchsorted(off[1:], torch.arange(M, device=dev), right=True)
    zero = torch.zeros((), dtype=f64, device=dev)

    def field(name: str) -> Tensor:  # masked positions may hold anything (NaN included): they become 0
        return torch.where(m, t[name].to(f64), zero)  # type: ignore[union-attr]

    def per_seq(x: Tensor) -> Tensor:
        return torch.zeros(S, dtype=f64, device=dev).index_add_(0, seq, x)

    def row_seq(x: Tensor, what: str) -> Tensor:  # a per-sequence sum over the whole row (no gradient flows through it)
        s = per_seq(x)
        return s if part is None else part.all_reduce(s, what)

    x = torch.where(m, lp.to(f64)[pos], zero)
    A, old = field("advantages"), field("old_logprobs")
    n = row_seq(mf, "the trainable tokens per sequence")  # trainable tokens per sequence
    T = torch.full((), float(c["global_tokens"]), dtype=f64, device=dev) if c["global_tokens"] > 0 else n.sum()
    G = torch.full((), float(c["global_sequences"]), dtype=f64, device=dev) if c["global_sequences"] > 0 else (n > 0).to(f64).sum()
    one = torch.ones((), dtype=f64, device=dev)

    def safe(d: torch.Tensor) -> torch.Tensor:  # a zero count only ever weighs masked occurrences
        return torch.where(d > 0, d, one)

    sw = t["seq_weight"]
    scale = (sw.to(f64) if sw is not None else torch.ones(S, dtype=f64, device=dev)) * c["loss_scale"]
    agg = c["aggregation"]
    if agg == "token-mean":
        w_seq = (1 / safe(T)).expand(S)
    elif agg == "seq-mean-token-sum":
        w_seq = (1 / safe(G)).expand(S)
    elif agg == "seq-mean-token-mean":
        w_seq = 1 / (safe(G) * safe(n))
    elif agg == "seq-mean-token-sum-norm":
        w_seq = torch.full((S,), 1 / c["norm_constant"], dtype=f64, device=dev)
    else:  # seq-mean-turn-mean-token-mean
        w_seq = None
    if w_seq is not None:
        w = (w_seq * scale)[seq] * mf
    else:  # a turn's weight 1 / (G·k·n_turn): k the sequence's turns with a trainable token, n_turn the turn's
        # Under context parallelism the turns are the whole row's (numbered by split_batch), their counts all-reduced.
        run, run_seq = terms.turn_runs(off, seq, cast(Tensor, t["turn_ids"])) if part is None else part.turns
        n_turn = torch.zeros(run_seq.shape[0], dtype=f64, device=dev).index_add_(0, run, mf)
        if part is not None:
            n_turn = part.all_reduce(n_turn, "the trainable tokens per turn")
        k = torch.zeros(S, dtype=f64, device=dev).index_add_(0, run_seq, (n_turn > 0).to(f64))
        w = torch.where(m, scale[seq] / (safe(G) * safe(k)[seq] * safe(n_turn[run])), zero)
    # The policy surrogate per occurrence.
    if c["policy"] == "cispo":
        value, r, high, low = terms.cispo(x, old, A, c)
        dual = torch.zeros_like(high)
    else:
        log_ratio = x - old
        if c["policy"] == "gspo":  # GSPO-token: the value of the sequence's mean log ratio, the derivative of each token's
            mean = row_seq(x.detach() - old, "GSPO's sequence log ratios") / safe(n)
            log_ratio = mean[seq] + (x - x.detach())
        value, r, high, low, dual = terms.clipped_surrogate(log_ratio, A, c)
    if c["tis"] == "token":
        value = value * terms.truncated_weight(old - field("rollout_logprobs"), c)
    elif c["tis"] == "sequence":
        value = value * terms.truncated_weight(row_seq(old - field("rollout_logprobs"), "the sequence TIS log weights"), c)[seq]
    pg = (w * torch.where(m, value, zero)).sum()
    if c["kl"] != "none":
        kl = (w * torch.where(m, terms.kl_term(c["kl"], x, field("ref_logprobs")), zero)).sum()
    else:
        kl = zero
    loss = pg + c["kl_coef"] * kl
    # Metrics: per trainable occurrence, unweighted (over the whole row under context parallelism).
    inf = torch.full((1,), float("inf"), dtype=f64, device=dev)
    r_min = torch.cat([torch.where(m, r, inf), inf]).amin()
    r_max = -torch.cat([torch.where(m, -r, inf), inf]).amin()
    sums = torch.stack(
        [loss.detach(), pg.detach(), kl.detach(), mf.sum()]
        + [(v.to(f64) * mf).sum() for v in (high & m, low & m, dual & m, old - x.detach(), r)]
    )
    if part is not None:
        sums = part.all_reduce(sums, "the loss metrics")
        extremes = part.all_reduce(torch.stack([r_min, -r_max]), "the ratio extremes", op="min")
        r_min, r_max = extremes[0], -extremes[1]
    cnt = sums[3]

    def mean_of(i: int) -> torch.Tensor:
        return sums[4 + i] / safe(cnt)

    live = cnt > 0
    metrics = {
        "loss": sums[0],
        "pg_loss": sums[1],
        "kl_loss": sums[2],
        "clipfrac_high": mean_of(0),
        "clipfrac_low": mean_of(1),
        "clipfrac_dual": mean_of(2),
        "approx_kl": mean_of(3),
        "ratio_min": torch.where(live, r_min, zero),
        "ratio_mean": mean_of(4),
        "ratio_max": torch.where(live, r_max, zero),
        "trainable_tokens": cnt,
    }
    return loss, torch.stack([metrics[k] for k in METRICS])


def packed_loss(
    lp: Tensor,
    batch: PackedBatch | Mapping[str, Any],
    config: None | Mapping[str, Any] | LossConfig = None,
    *,
    validate: bool = True,
    metrics: str = "float",
    router: RouterOutputs | None = None,
    aux_coef: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """The loss (a float64 0-d tensor on lp's device, differentiable w.r.t. lp) and its metrics (docs/concepts/loss.md:
    loss, pg_loss, kl_loss, clip fractions, approx_kl, ratio stats, trainable_tokens). ``batch`` is a ``PackedBatch`` or
    a mapping of the contract's tensors on lp's device (it may add ``seq_weight`` [S]). ``validate=False`` skips the
    value checks (host copies); ``metrics="tensor"`` returns 0-d float64 tensors on lp's device instead of floats.

    ``router`` (a MoE forward's ``NodeScores.router``) adds the router's load-balancing loss, counted per logical
    occurrence (``load_balancing_loss``), times ``aux_coef`` (default: the model's ``router_aux_loss_coef``), and
    the metric ``aux_loss`` (its value before the coefficient)."""
    if metrics not in ("float", "tensor"):
        raise TreepackError("E_ARG", f"metrics is {metrics!r}; expected 'float' or 'tensor'", field="metrics")
    c = resolve_config(config)
    t = loss_inputs(lp, batch, c, validate)
    loss, values = _loss(lp, t, c, _seq_index(batch), _context_parallel(batch))
    as_tensors = dict(zip(METRICS, values.unbind(0)))
    if router is not None:
        loss, aux, coef = _with_aux(loss, router, batch, aux_coef)
        as_tensors.update(loss=as_tensors["loss"] + coef * aux, aux_loss=aux)
    return loss, (metrics_to_floats(as_tensors) if metrics == "float" else as_tensors)


def _with_aux(loss: Tensor, router: RouterOutputs, batch: Batch, aux_coef: float | None) -> tuple[Tensor, Tensor, float]:
    """(loss + coefficient × load-balancing loss, the row's load-balancing loss for the metrics (detached), the
    coefficient). On a context-parallel local part the loss takes this rank's share (``load_balancing_loss``), the
    metric the row's (the shares summed over the group)."""
    coef = router.aux_coef if aux_coef is None else aux_coef
    if coef is None:
        raise TreepackError("E_ARG", "the model has no router_aux_loss_coef: pass aux_coef", field="aux_coef")
    aux = load_balancing_loss(router, batch).to(loss.device)
    row = aux.detach()
    part = _context_parallel(batch)
    if part is not None:
        row = part.all_reduce(row.clone(), "the load-balancing loss")
    return loss + float(coef) * aux, row, float(coef)


def metrics_to_floats(metrics: Mapping[str, Tensor]) -> dict[str, Any]:
    """The tensor metrics as Python numbers (one host copy): floats, trainable_tokens an int."""
    values = dict(zip(metrics, torch.stack([v.detach().to(torch.float64) for v in metrics.values()]).tolist()))
    if "trainable_tokens" in values:
        values["trainable_tokens"] = int(values["trainable_tokens"])
    return values


class PackedLoss:
    """``loss, metrics = PackedLoss.apply(lp, batch, config)``: ``packed_loss`` with the metrics as one float64 tensor
    on lp's device in ``METRICS`` order. ``PackedLoss(config, validate=False)`` resolves the config once and is
    called as ``loss_fn(lp, batch)`` (the form to compile). ``loss_fn(lp, batch, router=scores.router)`` adds a MoE
    router's load-balancing loss times ``aux_coef`` (``packed_loss``); the metrics then end with ``aux_loss``."""

    def __init__(
        self, config: None | Mapping[str, Any] | LossConfig = None, *, validate: bool = True, aux_coef: float | None = None
    ) -> None:
        self.config = resolve_config(config)
        self.validate = validate
        self.aux_coef = aux_coef

    def __call__(self, lp: Tensor, batch: PackedBatch | Mapping[str, Any], router: RouterOutputs | None = None) -> tuple[Tensor, Tensor]:
        """(loss, metrics [len(METRICS)], or [len(METRICS) + 1] with ``aux_loss`` last, float64 on lp's device)."""
        t = loss_inputs(lp, batch, self.config, self.validate)
        loss, values = _loss(lp, t, self.config, _seq_index(batch), _context_parallel(batch))
        if router is None:
            return loss, values
        loss, aux, coef = _with_aux(loss, router, batch, self.aux_coef)
        values = torch.cat([values, aux[None]])
        values[METRICS.index("loss")] += coef * aux  # the total, as packed_loss reports it
        return loss, values

    @staticmethod
    def apply(
        lp: Tensor,
        batch: PackedBatch | Mapping[str, Any],
        config: None | Mapping[str, Any] | LossConfig = None,
        *,
        validate: bool = True,
        router: RouterOutputs | None = None,
        aux_coef: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(loss, metrics float64 on lp's device) for a config given per call."""
        return PackedLoss(config, validate=validate, aux_coef=aux_coef)(lp, batch, router)


__all__ = ["METRICS", "PackedLoss", "loss_inputs", "metrics_to_floats", "packed_loss", "resolve_config"]
