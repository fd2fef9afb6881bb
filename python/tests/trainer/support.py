"""Shared by the trainer-side tests: what they need to run (the C core, torch) and the decorator that skips them,
saying why, where it is missing; forests packed by the C core (libtreepack_core.so, the cpu backend's packer), the
forest shapes the tests cover, and tiny random-weight Hugging Face models."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import unittest
from collections.abc import Sequence

import numpy as np

# python/tests holds the brute-force references these suites share with the numpy ones (mask_reference.py).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from treepack import MicroBatch, TreepackError
from treepack.loss import core_library
from treepack.pack import pack_sequences

try:
    core_library()
    CORE_SKIP = ""
except TreepackError as e:  # E_BACKEND: the C core is not built here
    CORE_SKIP = str(e)

try:
    import torch
    import treepack.torch as tpt

    TORCH_SKIP = ""
except ImportError as e:  # the suites skip (needs_torch); the names stay importable for their modules
    torch = tpt = None
    TORCH_SKIP = f"torch not importable ({e})"


def needs_torch(transformers: bool = False, cuda: str = ""):
    """The skip decorator of a trainer-side suite (a class or one test): skipped, with the reason, where the C core
    is not built, torch does not import, or, when asked, transformers is missing or there is no CUDA device (``cuda``
    says what needs one)."""
    reason = CORE_SKIP or TORCH_SKIP
    if not reason and transformers and importlib.util.find_spec("transformers") is None:
        reason = "transformers not importable"
    if not reason and cuda and not torch.cuda.is_available():
        reason = cuda
    return unittest.skipIf(bool(reason), reason)


FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "test", "fixtures", "loss_reference.json")


def pack(seqs: Sequence[Sequence[int]], pad: int = 0, seed: int = 0, floats: bool = True, packed: MicroBatch | None = None) -> MicroBatch:
    """``pack_sequences`` (the C core's packer) plus ``pad`` pad nodes appended as the budgeted packer does (roots of
    token 0 that attend only to themselves, ``num_pad_tokens``), random trainable masks and per-occurrence floats.
    ``packed``: the forest of ``seqs`` already packed (another packer's), padded and filled the same way."""
    mb = pack_sequences(seqs) if packed is None else packed
    N, M = len(mb.input_ids), len(mb.seq_positions)
    if pad:
        mb.input_ids = np.concatenate([mb.input_ids, np.zeros(pad, dtype=np.int32)])
        mb.position_ids = np.concatenate([mb.position_ids, np.zeros(pad, dtype=np.int32)])
        mb.parent = np.concatenate([mb.parent, np.full(pad, -1, dtype=np.int32)])
        mb.subtree_end = np.concatenate([mb.subtree_end, np.arange(N + 1, N + pad + 1, dtype=np.int32)])
        mb.meta.update(num_tokens_packed=N + pad, num_pad_tokens=pad)
    r = np.random.default_rng(seed)
    mb.loss_mask = (mb.loss_mask * (r.random(M) < 0.7)).astype(np.uint8)
    if floats:
        mb.advantages = r.standard_normal(M).astype(np.float32)
        for f in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            setattr(mb, f, (-r.random(M) * 3).astype(np.float32))
    return mb


def forests(vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
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
    """A 2-layer random-weight Qwen3 or Llama (GQA, RoPE) from transformers, in ``dtype``, eval mode (no dropout);
    in float64 its norms stay in float64 (``patch_norms_to_input_dtype``)."""
    import torch
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
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
    if dtype == torch.float64:
        patch_norms_to_input_dtype(model)
    return model


_ST = {np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32"}


def write_microbatch(path: str, mb: MicroBatch, metadata: dict[str, str] | None = None, dtypes: dict[str, str] | None = None) -> None:
    """A micro-batch file as the TypeScript writer lays it out (tests need files they can also break: ``metadata``
    overrides header keys, ``dtypes`` stores a field as another numpy dtype)."""
    import json

    arrays = {
        f: getattr(mb, f)
        for f in (
            "input_ids",
            "position_ids",
            "parent",
            "subtree_end",
            "seq_offsets",
            "seq_positions",
            "loss_mask",
            "advantages",
            "old_logprobs",
            "ref_logprobs",
            "rollout_logprobs",
            "image_pixels",
            "image_sizes",
            "image_grid_thw",
            "image_fills",
            "mrope_position_ids",
        )
        if getattr(mb, f) is not None
    }
    arrays.update(mb.extra)
    for k, dt in (dtypes or {}).items():
        arrays[k] = np.asarray(arrays[k]).astype(dt)
    meta = {k: (json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in mb.meta.items()}
    meta.update(metadata or {})
    header: dict[str, object] = {"__metadata__": meta}
    blobs, at = [], 0
    for k, a in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": _ST[np.asarray(a).dtype], "shape": list(np.shape(a)), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def patch_norms_to_input_dtype(model) -> None:
    """HF's Qwen3/Llama RMSNorm computes in float32 whatever the input dtype (~1e-7 of noise that float64 tests
    cannot tell from a bug); this keeps it in the input dtype, with the same formula."""
    import types

    import torch

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)


def spawned_ranks(worker, world: int) -> list:
    """Runs ``worker(rank, out)`` on ``world`` spawned processes, each saving what it found as ``out/rank{rank}.pt``:
    those, by rank. Spawned, not forked: a fork after torch's OpenMP pool has run leaves the children waiting on it."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(out,), nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
