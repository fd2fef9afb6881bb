"""The training step of `npm run bench`: forward + backward + the RL loss of a random-weight Qwen3-shape decoder on
three layouts of the same workload, measured in one process, interleaved:

- naive:  every LLM call its own sequence (what trainers do today), in micro-batches under the token budget;
- merged: the timelines after the timeline merge, each its own sequence (AgentJet-style), same budget (when the
  merge joined no call, these are naive's sequences: reported as naive's, not timed again);
  both through the stock transformers attention a trainer runs today (chain_attention: flash_attention_2 on the
  sequences packed in one row when flash_attn is importable, else sdpa one sequence per call), not tree attention;
- packed: treepack's micro-batches (prefix trees under the budget), tree attention; on a hybrid shape (Qwen3.5's
  Gated DeltaNet layers) also the recurrent layers' tree execution (treepack.torch.prepare).

Every side trains the same trainable tokens with the same loss (token-mean over the step's trainable tokens, PPO
clipping, old logprobs a fixed function of each trainable token and its position), so the loss, the sum of trainable
logprobs and the gradient norm must agree; a disagreement is reported and makes the run exit 2.

    python bench/step.py SPEC.json   # spec written by bench/step.ts; prints one JSON object on stdout

Uses the trainer side (python/treepack/torch): PackedDataset, naive_batch, the "treepack" attention, packed_logprobs
and packed_loss. The spec's optional "naive_attention" ("stock", the default, or "treepack": tree attention on the
chains, the bench's former naive path) picks the chain sides' attention (chain_attention). Device: CUDA when
available (bf16 weights, FlexAttention; the spec's CUDA shapes, Qwen3-0.6B and 4B), else CPU (float32, block-sparse
SDPA; the spec's small CPU shape).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Appended, not prepended: an environment that installed treepack (pip install ./python[torch]) keeps its own.
sys.path.append(os.path.join(ROOT, "python"))

try:
    import resource
except ImportError:  # Windows: no getrusage
    resource = None  # type: ignore[assignment]

import torch  # noqa: E402
import transformers  # noqa: E402
import treepack.torch as tpt  # noqa: E402  (registers attn_implementation "treepack")
from treepack.torch.logprobs import _head_and_base  # noqa: E402
from treepack.torch.segments import run_plan  # noqa: E402

SIDES = ("naive", "merged", "packed")
BLOCK = 128  # the tree mask's tile, as packed_logprobs builds it


def chains_under_budget(batches: list[tpt.PackedBatch], max_tokens: int) -> list[tpt.PackedBatch]:
    """Naive batches (every sequence its own chain) regrouped, whole sequences in order, into micro-batches of at most
    `max_tokens` tokens (a longer sequence alone), as a trainer without prefix sharing packs them."""
    out = []
    for b in batches:
        off = b.seq_offsets.tolist()
        S, start = len(off) - 1, 0
        for s in range(1, S):
            if off[s + 1] - off[start] > max_tokens:
                out.append(_sequences(b, start, s))
                start = s
        if S:
            out.append(_sequences(b, start, S))
    return out


def _sequences(b: tpt.PackedBatch, a: int, c: int) -> tpt.PackedBatch:
    """Sequences [a, c) of a naive batch (nodes = occurrences, in sequence order) as a batch of their own."""
    lo, hi = int(b.seq_offsets[a]), int(b.seq_offsets[c])
    occ = lambda t: None if t is None else t[lo:hi].clone()  # noqa: E731
    return tpt.PackedBatch(
        input_ids=b.input_ids[lo:hi].clone(),
        position_ids=b.position_ids[lo:hi].clone(),
        parent=torch.where(b.parent[lo:hi] < 0, -1, b.parent[lo:hi] - lo),
        subtree_end=b.subtree_end[lo:hi] - lo,
        seq_offsets=b.seq_offsets[a : c + 1] - lo,
        seq_positions=torch.arange(hi - lo),
        loss_mask=occ(b.loss_mask),
        seq_index=b.seq_index[lo:hi] - a,
        token_index=occ(b.token_index),
        meta=dict(b.meta),
        advantages=occ(b.advantages),
        old_logprobs=occ(b.old_logprobs),
        ref_logprobs=occ(b.ref_logprobs),
        rollout_logprobs=occ(b.rollout_logprobs),
    )


def with_old_logprobs(b: tpt.PackedBatch, vocab: torch.Tensor | None) -> tpt.PackedBatch:
    """Old logprobs as a fixed function of each occurrence's token and position (the same on every layout, and not
    the current policy's, so the PPO ratio and the loss value depend on the forward), and token ids remapped to the
    workload's distinct ids ``vocab`` (the LM head's cost is the same on every side; a 152k-row head would only
    dilute it); ``vocab`` None keeps the ids (a model with the tokenizer's full vocabulary)."""
    tok = b.input_ids[b.seq_positions]
    pos = b.position_ids[b.seq_positions]
    b.old_logprobs = (-0.5 - ((tok * 31 + pos) % 17).float() / 8).float()
    if vocab is not None:
        b.input_ids = torch.searchsorted(vocab, b.input_ids)
        b.meta["vocab_size"] = int(vocab.numel())  # the ids are now the workload's own vocabulary, the model's rows
    return b


def pad_to(b: tpt.PackedBatch, n: int) -> tpt.PackedBatch:
    """``b`` with pad nodes appended up to ``n`` nodes, as the packer pads (``--pad-multiple``): roots of token 0
    that attend only to themselves and that no occurrence maps to. Every micro-batch of a run then has one length,
    so the compiled attention is compiled once (a new length recompiles it)."""
    N = b.num_nodes
    if N > n:
        raise ValueError(f"a micro-batch of {N} tokens does not fit a budget of {n}")
    extra = torch.arange(N, n, device=b.device)
    b.input_ids = torch.cat([b.input_ids, torch.zeros_like(extra)])
    b.position_ids = torch.cat([b.position_ids, torch.zeros_like(extra)])
    b.parent = torch.cat([b.parent, torch.full_like(extra, -1)])
    b.subtree_end = torch.cat([b.subtree_end, extra + 1])
    b.meta["num_pad_tokens"] = b.num_pad_tokens + n - N
    b.meta["num_tokens_packed"] = n
    return b


def causal_tiles(b: tpt.PackedBatch) -> int:
    """BLOCK×BLOCK tiles a causal kernel visits running each of the batch's sequences alone (their occurrences): a
    sequence of n blocks visits n(n+1)/2, its diagonal ones partial."""
    lengths = torch.diff(b.seq_offsets).to(torch.int64)
    nb = (lengths + BLOCK - 1) // BLOCK
    return int((nb * (nb + 1) // 2).sum())


def figures(batches: list[tpt.PackedBatch], path: str) -> dict[str, int]:
    """Work figures of one side: tokens (padding included; pad_tokens of them are padding), visible attention pairs,
    listed BLOCK×BLOCK tiles and the tiles the side's attention visits (``path`` "flex": the listed ones; "block", the
    CPU block path: with its padding; "stock", a causal kernel per sequence: causal_tiles), scored rows; for recurrent
    layers, the sequential depth levels (radix segments' depth, summed over micro-batches), the batched calls of one
    layer and the tokens those calls hold with their padding."""
    f = {
        "micro_batches": len(batches),
        "tokens": 0,
        "pad_tokens": 0,
        "occurrences": 0,
        "trainable": 0,
        "pairs": 0,
        "blocks": 0,
        "full_blocks": 0,
        "executed_blocks": 0,
        "scored_rows": 0,
        "max_tokens": 0,
        "causal_tiles": 0,
        "levels": 0,
        "recurrent_calls": 0,
        "recurrent_padded": 0,
    }
    for b in batches:
        n = b.num_nodes
        f["tokens"] += n
        f["pad_tokens"] += b.num_pad_tokens
        f["max_tokens"] = max(f["max_tokens"], n)
        f["occurrences"] += b.num_occurrences
        f["trainable"] += int(b.loss_mask.sum())
        f["pairs"] += int((b.subtree_end - torch.arange(n)).sum())
        m = tpt.tree_mask(b, mode="block", block_size=BLOCK, device="cpu")
        listed = int(m.kv_num_blocks.sum() + m.full_kv_num_blocks.sum())
        f["blocks"] += listed
        alone = causal_tiles(b)
        f["causal_tiles"] += alone
        if path == "stock":
            f["executed_blocks"] += alone
        else:  # flex runs the BlockMask padded to its ladder rung (a tile per padded query block), block its SDPA plan
            runs = m if path == "block" else tpt.tree_mask(b, mode="flex", block_size=BLOCK, device="cpu")
            f["executed_blocks"] += tpt.executed_tiles(runs)
        f["full_blocks"] += int(m.full_kv_num_blocks.sum())
        f["scored_rows"] += int(torch.unique(b.parent[tpt.scored_nodes(b)]).numel())
        plan = run_plan(m, 1, torch.device("cpu"))
        f["levels"] += tpt.segments_of(m).num_levels
        f["recurrent_calls"] += len(plan.calls)
        f["recurrent_padded"] += plan.padded
    return f


def model_flops(f: dict[str, int], shape: dict[str, Any], vocab: int) -> float:
    """Model FLOPs of one side's step (forward + backward) from its figures, as bench/cost-model.ts ``work`` counts
    them for an attention-only shape: projections and MLP per real token (padding excluded), the LM head per scored
    row, attention per visible query/key pair (not per computed tile): the work the step needs, what MFU divides."""
    if shape.get("family", "qwen3") != "qwen3":
        raise ValueError(f"model_flops counts attention-only shapes; {shape['name']} has recurrent layers")
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    layer = shape["hidden"] * q + 2 * shape["hidden"] * kv + q * shape["hidden"] + 3 * shape["hidden"] * shape["intermediate"]
    linear = 2 * layer * shape["layers"] * (f["tokens"] - f.get("pad_tokens", 0)) + 2 * shape["hidden"] * vocab * f["scored_rows"]
    attention = 4 * shape["heads"] * shape["head_dim"] * shape["layers"] * (f["pairs"] - f.get("pad_tokens", 0))
    return 3.0 * (linear + attention)  # backward ≈ 2 × forward


def make_model(shape: dict[str, Any], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight Qwen3, or with ``family`` "qwen3_5" a Qwen3.5 text model whose layers are Gated DeltaNet but
    every fourth (``linear_layers`` of ``layers``, as Qwen3.5 interleaves them), prepared for tree execution."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=1 << 17,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    if shape.get("family") == "qwen3_5":
        full = shape["layers"] - shape["linear_layers"]
        types = ["full_attention" if (i + 1) * full % shape["layers"] < full else "linear_attention" for i in range(shape["layers"])]
        cfg = transformers.Qwen3_5TextConfig(
            layer_types=types,
            linear_num_key_heads=shape["linear_key_heads"],
            linear_num_value_heads=shape["linear_value_heads"],
            linear_key_head_dim=shape["linear_head_dim"],
            linear_value_head_dim=shape["linear_head_dim"],
            **common,
        )
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model = tpt.prepare(model.to(device=device, dtype=dtype))
    model.set_attn_implementation("treepack")
    model.train()
    return model


def recurrent_timer(model: torch.nn.Module, device: torch.device) -> dict[str, float]:
    """Forward seconds spent in the model's tree-aware recurrent layers, accumulated in the returned dict's "seconds"
    (hooks; the dict stays empty for a model without such layers)."""
    acc: dict[str, float] = {}
    layers = [m for m in model.modules() if hasattr(type(m), "treepack_base")]
    for layer in layers:

        def pre(module: torch.nn.Module, args: Any) -> None:
            sync(device)
            acc["_start"] = time.perf_counter()

        def post(module: torch.nn.Module, args: Any, out: Any) -> None:
            sync(device)
            acc["seconds"] = acc.get("seconds", 0.0) + time.perf_counter() - acc["_start"]

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    if layers:
        acc["seconds"] = 0.0
    return acc


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rss_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory(
    model: torch.nn.Module, batch: tpt.PackedBatch, config: dict[str, Any], device: torch.device, stock: str | None
) -> int | None:
    """Peak memory one micro-batch's forward + backward adds to what the process holds (its gradients included), untimed:
    a step with gradient accumulation peaks at its largest micro-batch (see peak_of)."""
    return peak_of(lambda: step(model, [batch], config, device, stock), model, device)


def peak_of(run: Callable[[], Any], model: torch.nn.Module, device: torch.device) -> int | None:
    """Peak memory ``run()`` adds to what the process holds, with ``model``'s gradients (zeroed first) counted. CUDA:
    the caching allocator's peak. CPU (Linux): the peak RSS, reset at the start, after the freed memory the timed
    steps keep for reuse has gone back to the OS; None where /proc is absent."""
    model.zero_grad(set_to_none=True)  # the step's gradients count in its peak
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        return int(torch.cuda.max_memory_allocated()) - base
    _malloc_trim()
    base = _rss_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    run()
    peak = _rss_bytes("VmHWM")
    return None if peak is None or base is None else peak - base


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where getrusage is absent): a timed CPU step should take none, or the
    allocator is handing memory back to the OS and faulting it in again (see bench/python.ts, harnessAllocator)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


STOCK_PATHS = {
    "flash_attention_2": "transformers flash_attention_2 (flash_attn varlen: the sequences packed in one row)",
    "sdpa": "transformers sdpa (one sequence per call, is_causal)",
}


def chain_attention(device: torch.device, choice: str) -> str | None:
    """The stock transformers attn_implementation the chain sides (naive, merged) run ("stock"), or None for treepack's
    tree attention on the chains ("treepack"). Stock, so the speedup is measured against what a trainer runs today,
    on the fastest path the device has: flash_attention_2 when flash_attn is importable (varlen over the
    micro-batch's sequences in one row), else sdpa on one sequence at a time (no padding; is_causal, torch's flash
    kernel, on CPU too). On the 2-core CPU host sdpa per sequence took 0.3-0.8 of the block path's naive step, to the
    same loss (docs/performance.md), so CPU rows use it too."""
    if choice not in ("stock", "treepack"):
        raise ValueError(f"naive_attention: expected stock or treepack, got {choice!r}")
    if choice == "treepack":
        return None
    return "flash_attention_2" if device.type == "cuda" and transformers.utils.is_flash_attn_2_available() else "sdpa"


def path_name(stock: str | None, device: torch.device) -> str:
    if stock:
        return STOCK_PATHS[stock]
    return "treepack FlexAttention + BlockMask" if device.type == "cuda" else "treepack block-sparse SDPA"


def side_logprobs(model: torch.nn.Module, b: tpt.PackedBatch, stock: str | None) -> torch.Tensor:
    """The trainable logprobs of a micro-batch: through the tree mask (stock None), or, for a chain batch (nodes =
    occurrences, sequence after sequence), the base model under the stock attention and the same head and logprobs."""
    if stock is None:
        return tpt.packed_logprobs(model, b).logprobs
    head, base = _head_and_base(model)
    ids, pos = b.input_ids[None], b.position_ids[None]
    if stock == "flash_attention_2":
        # transformers finds the sequences where the position ids restart at 0 and runs flash_attn's varlen kernel.
        hidden = base(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
    else:
        off = b.seq_offsets.tolist()
        if b.num_nodes > off[-1]:
            off.append(b.num_nodes)  # pad nodes past the last sequence (the packer's padding): a segment of their own
        hidden = torch.cat(
            [base(input_ids=ids[:, a:c], position_ids=pos[:, a:c], use_cache=False).last_hidden_state[0] for a, c in zip(off, off[1:])]
        )
    return tpt.packed_logprobs(hidden, b, lm_head=head).logprobs


def step(
    model: torch.nn.Module, batches: list[tpt.PackedBatch], config: dict[str, Any], device: torch.device, stock: str | None = None
) -> dict[str, float]:
    """One training step (gradient accumulation over the side's micro-batches), timed per stage; ``stock``: the
    attn_implementation of a chain side (chain_attention), None for tree attention."""
    t = {"masks": 0.0, "forward": 0.0, "loss": 0.0, "backward": 0.0}
    loss_sum, lp_sum = 0.0, 0.0
    timer = getattr(model, "treepack_bench_timer", {})
    recurrent = timer.get("seconds")
    if model.config._attn_implementation != (stock or "treepack"):
        model.set_attn_implementation(stock or "treepack")
    model.zero_grad(set_to_none=True)
    sync(device)
    faults = _minor_faults()
    start = time.perf_counter()
    for b in batches:
        t0 = time.perf_counter()
        # The mask alone, timed apart: packed_logprobs builds it again inside (so forward below includes it once
        # more, and the breakdown subtracts it). The stock paths build none.
        if stock is None:
            tpt.tree_mask(b)
        sync(device)
        t1 = time.perf_counter()
        lp = side_logprobs(model, b, stock)
        sync(device)
        t2 = time.perf_counter()
        # The trainer's device path: no value checks (host copies), metrics left on the device.
        loss, _ = tpt.packed_loss(lp, b, config, validate=False, metrics="tensor")
        sync(device)
        t3 = time.perf_counter()
        loss.backward()
        sync(device)
        t4 = time.perf_counter()
        t["masks"] += t1 - t0
        t["forward"] += max(0.0, (t2 - t1) - (t1 - t0))
        t["loss"] += t3 - t2
        t["backward"] += t4 - t3
        loss_sum += float(loss.detach())
        train = b.seq_positions[b.loss_mask.bool()]
        lp_sum += float(lp.detach()[train].double().sum())
    total = time.perf_counter() - start - t["masks"]  # the extra mask build is not part of a step
    faults = _minor_faults() - faults
    grad = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    if recurrent is not None:
        t["recurrent_forward"] = timer["seconds"] - recurrent
    # "loss" in t is the loss's seconds; its value is "loss_value".
    return {**t, "step": total, "page_faults": faults, "loss_value": loss_sum, "logprob_sum": lp_sum, "grad_norm": grad}


def agree(a: dict[str, float], b: dict[str, float], tol: float) -> list[str]:
    bad = []
    for k, rel in (("loss_value", tol), ("logprob_sum", tol), ("grad_norm", 10 * tol)):
        scale = max(abs(a[k]), abs(b[k]), 1e-6)
        if abs(a[k] - b[k]) > rel * scale:
            bad.append(f"{k} {a[k]:.8g} vs {b[k]:.8g}")
    return bad


def largest(batches: list[tpt.PackedBatch]) -> tpt.PackedBatch:
    return max(batches, key=lambda b: int(b.input_ids.numel()))


def run_workload(
    w: dict[str, Any], spec: dict[str, Any], shapes: list[dict[str, Any]], device: torch.device, dtype: torch.dtype, chain: str | None
) -> list[dict[str, Any]]:
    """The workload's sides, read from its packed directories, timed on a random-weight model of each shape: one
    result per shape; ``chain``: the chain sides' stock attention (chain_attention)."""
    T = w.get("max_tokens", spec["max_tokens"])
    packed = list(tpt.PackedDataset(w["packed_dir"]))
    # When the merge joined no call, the merged layout holds naive's sequences: it is not built or timed again.
    sides = ("naive", "packed") if w.get("merged_is_naive") else SIDES
    build = {
        "naive": lambda: chains_under_budget([tpt.naive_batch(b) for b in tpt.PackedDataset(w["calls_dir"])], T),
        "merged": lambda: chains_under_budget([tpt.naive_batch(b) for b in packed], T),
        "packed": lambda: packed,
    }
    return run_layouts(w, {k: build[k]() for k in sides}, shapes, device, dtype, chain)


def run_layouts(
    w: dict[str, Any],
    layouts: dict[str, list[tpt.PackedBatch]],
    shapes: list[dict[str, Any]],
    device: torch.device,
    dtype: torch.dtype,
    chain: str | None,
    vocab_size: int | None = None,
    pad: int | None = None,
) -> list[dict[str, Any]]:
    """Micro-batches of each side ("naive", optionally "merged", "packed"; CPU tensors) timed on a random-weight
    model of each shape: one result per shape. ``chain``: the chain sides' stock attention (chain_attention; None: tree
    attention); ``vocab_size``: the model's vocabulary, the ids kept (default: the ids remapped to the workload's
    distinct ones); ``pad``: every micro-batch padded to that many tokens (``pad_to``)."""
    sides = tuple(layouts)
    vocab = None if vocab_size else torch.unique(torch.cat([b.input_ids for bs in layouts.values() for b in bs]))
    layouts = {k: [with_old_logprobs(b, vocab) for b in bs] for k, bs in layouts.items()}
    if pad:
        layouts = {k: [pad_to(b, pad) for b in bs] for k, bs in layouts.items()}
    vocab_size = vocab_size or int(vocab.numel())
    tree = "flex" if device.type == "cuda" else "block"
    figs = {k: figures(bs, "stock" if chain and k != "packed" else tree) for k, bs in layouts.items()}
    if "merged" not in sides:
        figs["merged"] = figs["naive"]
    trainable = {figs[k]["trainable"] for k in sides}
    if len(trainable) != 1:
        error = "the sides train different token counts: " + ", ".join(f"{k} {figs[k]['trainable']}" for k in sides)
        return [{"name": w["name"], "input": w["input"], "shape": shape, "error": error, "figures": figs} for shape in shapes]
    config = {"policy": "ppo", "clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean", "global_tokens": float(trainable.pop())}
    layouts = {k: [b.to(device) for b in bs] for k, bs in layouts.items()}
    results = []
    for shape in shapes:
        base = {"name": w["name"], "input": w["input"], "shape": shape, "figures": figs, "vocab": vocab_size}
        try:
            results.append({**base, **time_sides(layouts, shape, vocab_size, config, w["repeats"], device, dtype, chain)})
        except torch.cuda.OutOfMemoryError as e:
            # A bigger shape may not fit the device at this micro-batch budget: a limit of the host, not a wrong
            # result; the other shapes still run.
            T = max(f["max_tokens"] for f in figs.values())
            results.append({**base, "skipped": f"out of GPU memory at micro-batches of up to {T} tokens: {str(e).splitlines()[0]}"})
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def time_sides(
    layouts: dict[str, list[tpt.PackedBatch]],
    shape: dict[str, Any],
    vocab: int,
    config: dict[str, Any],
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
    chain: str | None,
) -> dict[str, Any]:
    sides = tuple(layouts)
    stock = {k: None if k == "packed" else chain for k in sides}
    model = make_model(shape, vocab, device, dtype)
    model.treepack_bench_timer = recurrent_timer(model, device)
    # Warm-up (kernels, on CUDA the compiled attention, and the allocator) on the workload's largest micro-batch, on
    # each attention path: the heap then holds the most any timed step needs, and no timed step faults memory in.
    for path in dict.fromkeys(stock.values()):
        step(model, [largest([b for k in sides if stock[k] == path for b in layouts[k]])], config, device, path)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for _ in range(repeats):
        for k in sides:  # interleaved, so load from other processes lands on every side alike
            runs[k].append(step(model, layouts[k], config, device, stock[k]))
    best = {k: min(runs[k], key=lambda r: r["step"]) for k in sides}
    if best["naive"]["grad_norm"] == 0:
        # Zero advantages (a group whose rewards are all equal) give a zero loss and zero gradients on every side.
        return {
            "error": "the loss and its gradients are zero (equal rewards in every group): the sides' equality check would prove nothing"
        }
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    mismatches = {k: agree(best["naive"], best[k], tol) for k in sides if k != "naive"}
    out = {
        k: {
            **best[k],
            "steps": [r["step"] for r in runs[k]],
            "peak_bytes": peak_memory(model, largest(layouts[k]), config, device, stock[k]),
            "page_faults": max(r["page_faults"] for r in runs[k]),
            "attention": path_name(stock[k], device),
        }
        for k in sides
    }
    if "merged" not in sides:
        out["merged"] = {**out["naive"], "same_as_naive": True}
    return {"sides": out, "mismatches": {k: v for k, v in mismatches.items() if v}}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu" and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    # The model sizes of this device: a small one on CPU, real Qwen3 shapes on CUDA (bench/step.ts STEP_SHAPES).
    shapes = spec["shapes"][device.type]
    chain = chain_attention(device, spec.get("naive_attention") or "stock")
    results = []
    for i, w in enumerate(spec["workloads"]):
        t0 = time.perf_counter()
        if device.type not in w["devices"]:
            results.append(
                {"name": w["name"], "input": i, "shape": shapes[0], "skipped": f"timed on {' and '.join(w['devices'])} hosts only"}
            )
            print(f"  step [{i + 1}/{len(spec['workloads'])}] {w['name']}: skipped on {device.type}", file=sys.stderr, flush=True)
            continue
        for r in run_workload({**w, "input": i}, spec, shapes, device, dtype, chain):
            results.append(r)
            took = (
                ", ".join(f"{k} {r['sides'][k]['step']:.2f} s" for k in SIDES if not r["sides"][k].get("same_as_naive"))
                if "sides" in r
                else r.get("error", r.get("skipped", ""))
            )
            print(
                f"  step [{i + 1}/{len(spec['workloads'])}] {w['name']}, {r['shape']['name']}: best of {w['repeats']}: {took}; "
                f"workload took {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    mode = "flex" if device.type == "cuda" else "block"
    print(
        json.dumps(
            {
                "device": name,
                "device_type": device.type,
                "dtype": str(dtype).replace("torch.", ""),
                "attention": mode,
                "block_size": BLOCK,
                "naive_attention": path_name(chain, device),
                "packed_attention": path_name(None, device),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "workloads": results,
            }
        )
    )


if __name__ == "__main__":
    main()
