"""Token sequences → a packed micro-batch in process, through the C core (``tp_plan_create`` / ``tp_plan_layout`` in
libtreepack_core.so: the cpu backend's packer, byte for byte the TypeScript ``packForest``).

    >>> mb = pack_sequences([[1, 2, 3], [1, 2, 4]])     # N = 4 nodes for M = 6 tokens
    >>> mb.loss_mask                                      # 1 except each sequence's first token
    >>> pack_sequences([[1, 2, 3, 4, 5]], turns=[[1, 3]]).turn_ids   # [-1, 0, 0, 1, 1]: turns start at t = 1 and 3

For the whole pipeline (chat records, templates, timeline merge, budgets) use ``treepack pack`` or the library.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np

from .loss import core_library
from .microbatch import FORMAT, MicroBatch, TreepackError


def pack_sequences(sequences: Sequence[Sequence[int]], tokenizer: str = "unknown", sequence_ids: Optional[Sequence[str]] = None,
                   turns: Optional[Sequence[Sequence[int]]] = None) -> MicroBatch:
    """The forest of ``sequences`` (token ids) with the occurrence arrays; loss_mask 1 except at t = 0, no
    per-occurrence floats. ``turns``: per sequence, the token index where each of its assistant turns starts
    (increasing); they give the contract's ``turn_ids`` (token t: the turns starting at or before t, minus one), which
    the Flow-GRPO aggregation reads."""
    lengths = [len(s) for s in sequences]
    tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int64, count=sum(lengths))
    if tokens.size and (tokens.min() < 0 or tokens.max() > 2**31 - 1):
        raise TreepackError("E_ARG", "token ids must be in [0, 2^31)", field="sequences")
    tokens = tokens.astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    ids = [str(i) for i in range(len(lengths))] if sequence_ids is None else [str(x) for x in sequence_ids]
    if len(ids) != len(lengths):
        raise TreepackError("E_ARG", f"{len(ids)} sequence ids for {len(lengths)} sequences", field="sequence_ids")
    lib = core_library()
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.tp_plan_create.argtypes = [P, I64, P, I64, ctypes.POINTER(P), ctypes.POINTER(I64)]
    lib.tp_plan_layout.argtypes = [P, P, P, P, P, P]
    lib.tp_plan_free.argtypes = [P]
    plan, n = P(), I64()
    rc = lib.tp_plan_create(tokens.ctypes.data, len(tokens), offsets.ctypes.data, len(lengths), ctypes.byref(plan), ctypes.byref(n))
    if rc != 0:
        raise TreepackError("E_ARG", f"tp_plan_create: {lib.tp_status_string(rc).decode()}", field="sequences")
    N, M = n.value, len(tokens)
    arrays = [np.zeros(N, dtype=np.int32) for _ in range(4)] + [np.zeros(M, dtype=np.int32)]
    try:
        rc = lib.tp_plan_layout(plan, *(a.ctypes.data for a in arrays))
    finally:
        lib.tp_plan_free(plan)
    if rc != 0:
        raise TreepackError("E_ARG", f"tp_plan_layout: {lib.tp_status_string(rc).decode()}", field="sequences")
    input_ids, position_ids, parent, subtree_end, seq_positions = arrays
    loss_mask = np.ones(M, dtype=np.uint8)
    loss_mask[offsets[:-1][np.asarray(lengths) > 0]] = 0
    meta = {"format": FORMAT, "num_sequences": len(lengths), "num_tokens_naive": M, "num_tokens_packed": N, "tokenizer": tokenizer,
            "sequence_ids": ids}
    return MicroBatch(input_ids=input_ids, position_ids=position_ids, parent=parent, subtree_end=subtree_end, seq_offsets=offsets,
                      seq_positions=seq_positions, loss_mask=loss_mask, meta=meta, turn_ids=_turn_ids(turns, lengths))


def _turn_ids(turns: Optional[Sequence[Sequence[int]]], lengths: Sequence[int]) -> Optional[np.ndarray]:
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
