"""Shared by the trainer-side tests: forests packed by the C core (libtreepack_core.so, the cpu backend's packer),
the forest shapes the tests cover, and tiny random-weight Hugging Face models."""

from __future__ import annotations

import ctypes
import os
import random
from typing import Dict, List, Optional, Sequence

import numpy as np

from treepack import FORMAT, MicroBatch
from treepack.loss import core_library

try:
    core_library()
    CORE_SKIP = ""
except OSError as e:
    CORE_SKIP = str(e)

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "shared", "fixtures", "loss_reference.json")


def pack(seqs: Sequence[Sequence[int]], pad: int = 0, seed: int = 0, floats: bool = True) -> MicroBatch:
    """Packs token sequences with tp_plan_create / tp_plan_layout; ``pad`` pad nodes appended as the budgeted
    packer does (roots of token 0 that attend only to themselves, ``num_pad_tokens``); random trainable masks and
    per-occurrence floats."""
    lib = core_library()
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.tp_plan_create.argtypes = [P, I64, P, I64, ctypes.POINTER(P), ctypes.POINTER(I64)]
    lib.tp_plan_layout.argtypes = [P, P, P, P, P, P]
    lib.tp_plan_free.argtypes = [P]
    tokens = np.array([t for s in seqs for t in s], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    plan, n = P(), I64()
    assert lib.tp_plan_create(tokens.ctypes.data, len(tokens), offsets.ctypes.data, len(seqs), ctypes.byref(plan), ctypes.byref(n)) == 0
    N, M = n.value, len(tokens)
    arrays = [np.zeros(N, dtype=np.int32) for _ in range(4)] + [np.zeros(M, dtype=np.int32)]
    try:
        assert lib.tp_plan_layout(plan, *(a.ctypes.data for a in arrays)) == 0
    finally:
        lib.tp_plan_free(plan)
    input_ids, position_ids, parent, subtree_end, seq_positions = arrays
    if pad:
        input_ids = np.concatenate([input_ids, np.zeros(pad, dtype=np.int32)])
        position_ids = np.concatenate([position_ids, np.zeros(pad, dtype=np.int32)])
        parent = np.concatenate([parent, np.full(pad, -1, dtype=np.int32)])
        subtree_end = np.concatenate([subtree_end, np.arange(N + 1, N + pad + 1, dtype=np.int32)])
    r = np.random.default_rng(seed)
    mask = (r.random(M) < 0.7).astype(np.uint8)
    mask[offsets[:-1][np.diff(offsets) > 0]] = 0
    meta = {"format": FORMAT, "num_sequences": len(seqs), "num_tokens_naive": M, "num_tokens_packed": N + pad,
            "tokenizer": "test", "sequence_ids": [str(i) for i in range(len(seqs))]}
    if pad:
        meta["num_pad_tokens"] = pad
    fl: Dict[str, Optional[np.ndarray]] = {}
    for f in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
        fl[f] = None
        if floats:
            fl[f] = (r.standard_normal(M) if f == "advantages" else -r.random(M) * 3).astype(np.float32)
    return MicroBatch(input_ids=input_ids, position_ids=position_ids, parent=parent, subtree_end=subtree_end,
                      seq_offsets=offsets, seq_positions=seq_positions, loss_mask=mask, meta=meta, **fl)


def forests(vocab: int, seed: int = 0) -> Dict[str, List[List[int]]]:
    """The shapes every equality test runs on: deep and wide branching, duplicates, a sequence that is a prefix of
    another, and a random mix (pad nodes are added by ``pack``)."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(vocab) for _ in range(n)]  # noqa: E731
    stem = tok(6)
    deep = [stem]
    for _ in range(5):  # a chain of branch points, each one deeper than the last
        deep.append(deep[-1][: len(deep[-1]) - r.randrange(0, 2)] + tok(r.randrange(2, 5)))
    wide = [stem + [t] + tok(r.randrange(0, 3)) for t in r.sample(range(vocab), min(12, vocab))]
    dup = [stem + [1, 2, 3], stem + [1, 2, 3], stem + [1, 2], tok(4), tok(4)]
    prefix = [stem[:3], stem, stem + [5, 6], tok(1)]
    mixed = []
    for _ in range(10):
        base = r.choice(mixed) if mixed and r.random() < 0.7 else []
        mixed.append(base[: r.randrange(0, len(base) + 1)] + tok(r.randrange(1, 8)))
    return {"deep": deep, "wide": wide, "duplicates": dup, "prefix": prefix, "mixed": mixed}


def tiny_model(family: str, dtype, attn: str = "treepack", vocab: int = 97, seed: int = 0):
    """A 2-layer random-weight Qwen3 or Llama (GQA, RoPE) from transformers, in ``dtype``, eval mode (no dropout)."""
    import torch
    import transformers

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    model.set_attn_implementation(attn)
    model.eval()
    return model
