"""Bench of the PyTorch trainer side (python/treepack/torch), for `npm run bench`:

1. node logprobs: ``packed_logprobs`` (LM head only at the nodes that predict a trainable token, in chunks of at most
   1,024 rows, the default) against full logits (``lm_head(hidden)`` over all N nodes, then log_softmax and a
   gather), forward + backward, on hidden states (256 wide) and a Qwen3 vocabulary (151,936), on two forests: an
   agent one (multi-turn episodes, only the assistant's tokens trainable: about a quarter of the nodes scored, the
   usual case) and a single-turn one (every completion token trainable: about three quarters scored, the worst
   case);
2. tree attention, forward + backward: the block-sparse path against SDPA with the dense tree mask, N = 4k–32k.

``--quick``: logprobs at N = 512, attention at 4k (seconds); else (`npm run bench -- --full`'s) logprobs at 4k,
attention at 4k–32k.

Each case runs in its own process, so its peak memory is its own: peak RSS above the set-up (CPU) or
``torch.cuda.max_memory_allocated`` above the set-up (CUDA), over a first call and the timed runs. Attention times
are the median of ``--repeat`` runs after that first call. A logprobs case is one call, timed, with no warm-up: at
N = 4k one full-logits call takes ~35 s on a 2-core CPU, and what a first call adds (thread pools) is milliseconds.
Ratios are against the baseline measured in the same run on the same forest (full logits; dense mask). A baseline
case whose big tensors alone would pass ``--max-gib`` is reported as skipped with that size, not run.

    python bench/torch_trainer.py [--quick] [--kind logprobs|attention] [--device cpu|cuda] [--json FILE]

Forests are built by the C core (``treepack.pack_sequences``). Prints a table; ``--json`` writes
{"device", "torch", "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


# Groups of 8 rollouts of one prompt. Full-size groups; a smaller target scales every length down alike.
SHAPES = {
    # Multi-turn agent episodes: prompt 1024, then 4 turns of an assistant message (64 tokens, trainable) and a tool
    # result (192, not trainable). Only the prompt is shared.
    "agent": {"prompt": 1024, "turns": [(64, True), (192, False)] * 4, "stems": 8},
    # Single-turn GRPO: prompt 1024, pairs of completions sharing a 64-token stem, tails of 320; every completion
    # token trainable.
    "single-turn": {"prompt": 1024, "turns": [(64, True), (320, True)], "stems": 4},
}


def forest(tokens: int, shape: str, seed: int = 0) -> Any:
    """About `tokens` packed nodes of `shape` (SHAPES); prompts are never trainable."""
    import numpy as np
    from treepack.pack import pack_sequences

    r = random.Random(seed)
    spec = SHAPES[shape]
    per_stem = 8 // spec["stems"]
    stem_len, stem_trained = spec["turns"][0]
    unit = spec["prompt"] + spec["stems"] * stem_len + 8 * sum(n for n, _ in spec["turns"][1:])
    scale = min(1.0, tokens / unit)
    size = lambda n: max(1, round(n * scale))  # noqa: E731
    ids = lambda n: [r.randrange(151_000) for _ in range(size(n))]  # noqa: E731
    seqs: list[list[int]] = []
    masks: list[list[bool]] = []
    for _ in range(max(1, round(tokens / unit))):
        prompt = ids(spec["prompt"])
        for _ in range(spec["stems"]):
            stem = ids(stem_len)
            for _ in range(per_stem):
                seq, mask = prompt + stem, [False] * len(prompt) + [stem_trained] * len(stem)
                for n, trained in spec["turns"][1:]:
                    part = ids(n)
                    seq, mask = seq + part, mask + [trained] * len(part)
                seqs.append(seq)
                masks.append(mask)
    mb = pack_sequences(seqs)
    mb.loss_mask = (mb.loss_mask & np.concatenate(masks)).astype(np.uint8)
    return mb


def peak_tracker(device: str) -> Any:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
        return lambda: torch.cuda.max_memory_allocated() - base
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return lambda: max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch
    import treepack.torch as tpt

    torch.manual_seed(0)
    dev = case["device"]
    batch = tpt.load_microbatch(forest(case["tokens"], case["forest"]), device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    nodes = tpt.scored_nodes(batch)
    rows = int(torch.unique(batch.parent[nodes]).numel())
    if case["kind"] == "logprobs":
        hidden = torch.randn(batch.num_nodes, case["hidden"], device=dev) * 0.1
        head = torch.nn.Linear(case["hidden"], case["vocab"], bias=False, device=dev)

        def once() -> None:
            h = hidden.clone().requires_grad_(True)
            if case["method"] == "full logits":
                logp = torch.log_softmax(head(h).float(), dim=-1)
                lp = logp[batch.parent[nodes], batch.input_ids[nodes]]
            else:
                lp = tpt.packed_logprobs(h, batch, lm_head=head, chunk_size=case["chunk"]).logprobs[nodes]
            lp.sum().backward()
            head.weight.grad = None
    else:
        mask = tpt.tree_mask(batch, mode=case["method"], block_size=128)
        H, D = case["heads"], case["head_dim"]
        qkv = [torch.randn(1, h, batch.num_nodes, D, device=dev) for h in (H, H // 2, H // 2)]

        def once() -> None:
            q, k, v = (x.clone().requires_grad_(True) for x in qkv)
            tpt.attend(mask, q, k, v).sum().backward()

    peak = peak_tracker(dev)  # from before the first call: what it builds and caches counts too
    if case["warmup"]:
        once()
        sync()
    times = []
    for _ in range(case["repeat"]):
        t0 = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t0)
    return {
        **case,
        "packed_tokens": batch.num_nodes,
        "naive_tokens": batch.num_occurrences,
        "scored_nodes": int(nodes.numel()),
        "head_rows": rows,
        "seconds": statistics.median(times),
        "peak_bytes": peak(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument(
        "--max-gib", type=float, default=12.0, help="skip a baseline case (dense mask, full logits) whose big tensors alone need more"
    )
    ap.add_argument("--kind", choices=("logprobs", "attention"), help="only this kind of case")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    repeat = args.repeat or (1 if args.quick else 3)
    cases: list[dict[str, Any]] = []
    for n in (512,) if args.quick else (4096,):
        for shape in SHAPES:
            for method in ("full logits", "packed_logprobs"):
                cases.append(
                    {
                        "kind": "logprobs",
                        "forest": shape,
                        "method": method,
                        "tokens": n,
                        "hidden": 256,
                        "vocab": 151_936,
                        "chunk": 1024,
                        "warmup": False,
                        "repeat": 1,
                    }
                )
    for n in (4096,) if args.quick else (4096, 8192, 16384, 32768):
        for method in ("dense", "block"):
            # One timed run from 16k, where a case costs tens of seconds on CPU.
            cases.append(
                {
                    "kind": "attention",
                    "forest": "single-turn",
                    "method": method,
                    "tokens": n,
                    "heads": 4,
                    "head_dim": 64,
                    "warmup": True,
                    "repeat": 1 if n > 8192 else repeat,
                }
            )
    rows: list[dict[str, Any]] = []
    if args.kind in (None, "logprobs"):
        print(
            f"logprobs: forward + backward on hidden states ({cases[0]['hidden']} wide), vocabulary {cases[0]['vocab']:,} (Qwen3), "
            f"packed_logprobs in chunks of at most {cases[0]['chunk']:,} rows; one timed call per case, {dev}",
            flush=True,
        )
    for case in [c for c in cases if args.kind in (None, c["kind"])]:
        case["device"] = dev
        need, what = 0, ""
        if case["kind"] == "attention" and case["method"] == "dense":
            need, what = (
                case["heads"] * case["tokens"] ** 2 * 4 * 3,
                "dense attention matrices",
            )  # scores, probabilities, their gradient; float32
        if case["kind"] == "logprobs" and case["method"] == "full logits":
            need, what = case["tokens"] * case["vocab"] * 4 * 3, "full logits"  # logits, log_softmax, their gradient; float32
        if need > args.max_gib * 2**30:
            why = f"the {what} alone need {need / 2**30:.1f} GiB (> --max-gib {args.max_gib:g}; the machine has {_ram_gib():.0f} GiB)"
            rows.append({**case, "skipped": why})
            print(format_row(rows[-1], rows), flush=True)
            continue
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", json.dumps(case)], capture_output=True, text=True)
        if res.returncode != 0:
            rows.append({**case, "skipped": f"failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}"})
        else:
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(format_row(rows[-1], rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=2)


def _ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _ratio(base: float, value: float, better: str, worse: str) -> str:
    """A ratio that reads right either way: "1.8x slower", never "0.6x faster"."""
    value = max(value, 1e-12)
    return f"{base / value:.2f}x {better}" if base >= value else f"{value / max(base, 1e-12):.2f}x {worse}"


def format_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    what = f"{row['kind']:<9} {row['method']:<16} {row['forest']:<11} N={row['tokens']:>6}"
    if "skipped" in row:
        return f"{what}  skipped: {row['skipped']}"
    if row["kind"] == "logprobs":
        what += (
            f" (packed {row['packed_tokens']}, {row['scored_nodes'] / row['packed_tokens']:.0%} scored, head at {row['head_rows']} rows)"
        )
    else:
        what += f" (packed {row['packed_tokens']}, naive {row['naive_tokens']})"
    base_method = "full logits" if row["kind"] == "logprobs" else "dense"
    base = next(
        (
            r
            for r in rows
            if (r["kind"], r["forest"], r["tokens"], r["method"]) == (row["kind"], row["forest"], row["tokens"], base_method)
            and "seconds" in r
        ),
        None,
    )
    ratio = ""
    if base is not None and base is not row:
        saved = base["peak_bytes"] - row["peak_bytes"]
        ratio = (
            f"  vs {base_method}: {_ratio(base['seconds'], row['seconds'], 'faster', 'slower')}, "
            f"{_ratio(base['peak_bytes'], row['peak_bytes'], 'less memory', 'more memory')} "
            f"({'saves' if saved >= 0 else 'costs'} {abs(saved) / 2**20:.0f} MiB)"
        )
    return f"{what}  {row['seconds'] * 1000:9.1f} ms  peak +{row['peak_bytes'] / 2**20:8.1f} MiB{ratio}"


if __name__ == "__main__":
    main()
