"""Token sequences → a packed micro-batch in process, through the C core (``tp_plan_create`` / ``tp_plan_layout`` in
libtreepack_core.so: the cpu backend's packer, byte for byte the TypeScript ``packForest``), with the per-token fields
trainers have.

    >>> mb = pack_sequences([[1, 2, 3], [1, 2, 4]])     # N = 4 nodes for M = 6 tokens
    >>> mb.input_ids.tolist(), mb.parent.tolist()         # the forest: token 3 and token 4 share the parent 2
    ([1, 2, 3, 4], [-1, 0, 1, 1])
    >>> mb.seq_positions.tolist()                         # each token's node, sequence after sequence
    [0, 1, 2, 0, 1, 3]
    >>> mb.loss_mask.tolist()                             # 1 except each sequence's first token
    [0, 1, 1, 0, 1, 1]
    >>> mb = pack_sequences([[1, 2, 3], [1, 2, 4]], loss_mask=[[0, 0, 1], [0, 0, 1]], advantages=[1.0, -1.0],
    ...                     old_logprobs=[[0, -0.5, -0.2], [0, -0.5, -1.3]])
    >>> mb.advantages.tolist()                            # one number per sequence: its trainable tokens, 0 elsewhere
    [0.0, 0.0, 1.0, 0.0, 0.0, -1.0]
    >>> pack_sequences([[1, 2, 3, 4, 5]], turns=[[1, 3]]).turn_ids.tolist()   # turns start at t = 1 and 3
    [-1, 0, 0, 1, 1]

For the whole pipeline (chat records, templates, timeline merge, budgets) use ``treepack pack`` or the library.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from . import _native
from .errors import TreepackError
from .microbatch import FORMAT, OCCURRENCE_FLOAT_FIELDS, MicroBatch

# Per sequence: a list (or array) with one value per token, or for advantages also one number for the sequence.
PerToken = Optional[Sequence[Union[Sequence[float], np.ndarray, float]]]


def _per_token(field: str, values: Sequence[Any], lengths: list[int], dtype: type, scalar: bool) -> np.ndarray:
    """``values`` (one entry per sequence) concatenated in occurrence order as ``dtype`` [M]; a scalar entry (when
    ``scalar``) fills its sequence. Errors name the field and the sequence."""
    if len(values) != len(lengths):
        raise TreepackError("E_ARG", f"{field} has {len(values)} entries for {len(lengths)} sequences", field=field)
    parts: list[np.ndarray] = []
    for i, (v, n) in enumerate(zip(values, lengths)):
        if scalar and np.ndim(v) == 0:
            parts.append(np.full(n, v, dtype=dtype))
            continue
        try:
            a: np.ndarray = np.asarray(v, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise TreepackError("E_ARG", f"{field}[{i}] (sequence {i}) is not numbers: {e}", field=field) from None
        if a.shape != (n,):
            raise TreepackError("E_ARG", f"{field}[{i}] has shape {list(a.shape)} but sequence {i} has {n} tokens", field=field)
        parts.append(a)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _loss_mask(given: PerToken, lengths: list[int], starts: np.ndarray) -> np.ndarray:
    """The given mask, 0/1 and 0 at every t = 0; by default 1 except at t = 0."""
    if given is None:
        mask = np.ones(sum(lengths), dtype=np.uint8)
        mask[starts] = 0
        return mask
    raw = _per_token("loss_mask", given, lengths, np.float64, scalar=False)
    bad = np.flatnonzero((raw != 0) & (raw != 1))
    if bad.size:
        raise TreepackError("E_ARG", f"loss_mask holds {raw[bad[0]]} at occurrence {bad[0]}; expected 0 or 1", field="loss_mask")
    # Token 0 of a sequence is never predicted, so the contract keeps it out of the loss. A 1 there is refused rather
    # than cleared: it usually means a mask shifted by one (aligned with labels instead of tokens).
    first = np.flatnonzero(raw[starts] != 0)
    if first.size:
        i = int(np.flatnonzero(np.asarray(lengths) > 0)[first[0]])
        raise TreepackError(
            "E_ARG",
            f"loss_mask[{i}][0] (sequence {i}) is 1: a sequence's first token is never predicted, so its mask is 0 there "
            "(give masks aligned with the tokens: mask[t] = 1 where token t is trained)",
            field="loss_mask",
        )
    return raw.astype(np.uint8)


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    tokenizer: str = "unknown",
    sequence_ids: Sequence[str] | None = None,
    *,
    loss_mask: PerToken = None,
    advantages: PerToken = None,
    old_logprobs: PerToken = None,
    ref_logprobs: PerToken = None,
    rollout_logprobs: PerToken = None,
    turns: Sequence[Sequence[int]] | None = None,
) -> MicroBatch:
    """The forest of ``sequences`` (token ids) with the occurrence arrays of the contract (docs/design.md §3).

    Per-token fields give one entry per sequence, aligned with its tokens (value t belongs to token t):

    - ``loss_mask``: 0/1; token t is trained where 1. 0 at t = 0 (refused otherwise). Default: 1 except t = 0.
    - ``advantages``: a list per sequence, or one number per sequence, broadcast to its trainable tokens (0 elsewhere).
    - ``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs``: the logprob of token t given tokens < t (the value at
      t = 0 is never read).

    Every float must be finite where the mask is 1. A field not given is absent from the batch (None).

    ``turns``: per sequence, the token index where each of its assistant turns starts (increasing); they give the
    contract's ``turn_ids`` (token t: the turns starting at or before t, minus one), which the Flow-GRPO aggregation
    reads.
    """
    lengths = [len(s) for s in sequences]
    tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int64, count=sum(lengths))
    if tokens.size and (tokens.min() < 0 or tokens.max() > 2**31 - 1):
        raise TreepackError("E_ARG", "token ids must be in [0, 2^31)", field="sequences")
    tokens = tokens.astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    ids = [str(i) for i in range(len(lengths))] if sequence_ids is None else [str(x) for x in sequence_ids]
    if len(ids) != len(lengths):
        raise TreepackError("E_ARG", f"{len(ids)} sequence ids for {len(lengths)} sequences", field="sequence_ids")

    starts = offsets[:-1][np.asarray(lengths, dtype=np.int64) > 0]
    mask = _loss_mask(loss_mask, lengths, starts)
    trainable = mask != 0
    seq_of = np.repeat(np.arange(len(lengths)), lengths)
    floats: dict[str, np.ndarray | None] = {}
    for field, given in zip(OCCURRENCE_FLOAT_FIELDS, (advantages, old_logprobs, ref_logprobs, rollout_logprobs)):
        if given is None:
            floats[field] = None
            continue
        a = _per_token(field, given, lengths, np.float32, scalar=field == "advantages")
        if field == "advantages":
            a = np.where(trainable, a, np.float32(0))
        bad = np.flatnonzero(trainable & ~np.isfinite(a))
        if bad.size:
            k = int(bad[0])
            i = int(seq_of[k])
            raise TreepackError("E_ARG", f"{field}[{i}][{k - offsets[i]}] (sequence {i}) is {a[k]} at a trainable token", field=field)
        floats[field] = a

    lib = _native.core()
    plan, n = ctypes.c_void_p(), ctypes.c_int64()
    P = _native.pointer
    rc = lib.tp_plan_create(P(tokens), len(tokens), P(offsets), len(lengths), ctypes.byref(plan), ctypes.byref(n))
    _native.check(rc, "tp_plan_create", "sequences")
    N, M = n.value, len(tokens)
    arrays = [np.zeros(N, dtype=np.int32) for _ in range(4)] + [np.zeros(M, dtype=np.int32)]
    try:
        rc = lib.tp_plan_layout(plan, *map(P, arrays))
    finally:
        lib.tp_plan_free(plan)
    _native.check(rc, "tp_plan_layout", "sequences")
    input_ids, position_ids, parent, subtree_end, seq_positions = arrays
    meta = {
        "format": FORMAT,
        "num_sequences": len(lengths),
        "num_tokens_naive": M,
        "num_tokens_packed": N,
        "tokenizer": tokenizer,
        "sequence_ids": ids,
    }
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        parent=parent,
        subtree_end=subtree_end,
        seq_offsets=offsets,
        seq_positions=seq_positions,
        loss_mask=mask,
        meta=meta,
        turn_ids=_turn_ids(turns, lengths),
        extra={},
        **floats,
    )


def _turn_ids(turns: Sequence[Sequence[int]] | None, lengths: Sequence[int]) -> np.ndarray | None:
    """The turn_ids [M] of per-sequence turn starts (src/pack/turns.ts defines the same from message boundaries)."""
    if turns is None:
        return None
    if len(turns) != len(lengths):
        raise TreepackError("E_ARG", f"{len(turns)} turn lists for {len(lengths)} sequences", field="turns")
    out = []
    for i, (starts, n) in enumerate(zip(turns, lengths)):
        st = np.asarray(starts, dtype=np.int64).reshape(-1)
        if st.size and (st[0] < 0 or st[-1] >= n or (np.diff(st) <= 0).any()):
            raise TreepackError("E_ARG", f"turns[{i}] = {list(starts)}: expected increasing token indices in [0, {n})", field="turns")
        out.append(np.searchsorted(st, np.arange(n), side="right") - 1)
    return np.concatenate(out).astype(np.int32) if out else np.zeros(0, dtype=np.int32)
