"""Bench of the PyTorch trainer side (python/treepack/torch), for `npm run bench`:

1. node logprobs: ``packed_logprobs`` (LM head only at the nodes that predict a trainable token, chunked and
   checkpointed) against full logits (``lm_head(hidden)`` over all N nodes, then log_softmax and a gather), forward
   + backward, on hidden states and a Qwen3-sized vocabulary;
2. tree attention, forward + backward: the block-sparse path against SDPA with the dense tree mask, N = 4k–32k
   (``--quick``, the default run's: logprobs at N = 512, attention at 4k).

Each case runs in its own process, so its peak memory is its own: peak RSS above the set-up (CPU) or
``torch.cuda.max_memory_allocated`` above the set-up (CUDA), over a first call and the timed runs. Times are the
median of ``--repeat`` runs after that first call. Ratios are against the baseline measured in the same run (full logits; dense mask). A baseline case
(dense mask, full logits) whose big tensors alone would pass ``--max-gib`` is reported as skipped with that size, not run.

    python bench/torch_trainer.py [--quick] [--device cpu|cuda] [--json FILE]

The forest is GRPO-shaped: groups of 8 completions branching off a shared prompt, built by the C core
(``treepack.pack_sequences``). Prints a table; ``--json`` writes {"device", "rows": [...]}.
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
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def forest(tokens: int, seed: int = 0) -> Any:
    """About `tokens` packed nodes in groups of one prompt and 8 completions, pairs of completions sharing a stem
    (a full group: prompt 1024, stems 64, completions 320 tokens; smaller targets scale one group down); 70% of the
    completion tokens trainable, prompts never."""
    import numpy as np

    from treepack.pack import pack_sequences

    r = random.Random(seed)
    unit = 1024 + 4 * 64 + 8 * 320
    scale = min(1.0, tokens / unit)
    prompt_len, stem_len, tail_len = (max(1, round(x * scale)) for x in (1024, 64, 320))
    seqs: List[List[int]] = []
    for _ in range(max(1, round(tokens / unit))):
        prompt = [r.randrange(151_000) for _ in range(prompt_len)]
        for _ in range(4):
            stem = [r.randrange(151_000) for _ in range(stem_len)]
            for _ in range(2):
                seqs.append(prompt + stem + [r.randrange(151_000) for _ in range(tail_len)])
    mb = pack_sequences(seqs)
    rng = np.random.default_rng(seed)
    mb.loss_mask = (mb.loss_mask * (rng.random(len(mb.loss_mask)) < 0.7)).astype(np.uint8)
    for s in mb.seq_offsets[:-1]:
        mb.loss_mask[s : s + prompt_len] = 0
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


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    import treepack.torch as tpt

    torch.manual_seed(0)
    dev = case["device"]
    batch = tpt.load_microbatch(forest(case["tokens"]), device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if case["kind"] == "logprobs":
        hidden = torch.randn(batch.num_nodes, case["hidden"], device=dev) * 0.1
        head = torch.nn.Linear(case["hidden"], case["vocab"], bias=False, device=dev)
        nodes = tpt.scored_nodes(batch)

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

    peak = peak_tracker(dev)  # from before the warm-up: what the first call builds and caches counts too
    once()
    sync()
    times = []
    for _ in range(case["repeat"]):
        t0 = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t0)
    return {**case, "packed_tokens": batch.num_nodes, "naive_tokens": batch.num_occurrences, "scored_nodes": int(tpt.scored_nodes(batch).numel()),
            "seconds": statistics.median(times), "peak_bytes": peak()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--max-gib", type=float, default=12.0, help="skip a baseline case (dense mask, full logits) whose big tensors alone need more")
    ap.add_argument("--kind", choices=("logprobs", "attention"), help="only this kind of case")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    repeat = args.repeat or (1 if args.quick else 3)
    cases: List[Dict[str, Any]] = []
    for n in (512,) if args.quick else (1024, 4096):
        for method in ("full logits", "packed_logprobs"):
            cases.append({"kind": "logprobs", "method": method, "tokens": n, "hidden": 256, "vocab": 151_936, "chunk": 512})
    for n in (4096,) if args.quick else (4096, 8192, 16384, 32768):
        for method in ("dense", "block"):
            cases.append({"kind": "attention", "method": method, "tokens": n, "heads": 4, "head_dim": 64})
    rows: List[Dict[str, Any]] = []
    for case in [c for c in cases if args.kind in (None, c["kind"])]:
        # One timed run where a case costs tens of seconds on CPU (a Qwen3 vocabulary's logits; attention from 16k).
        case.update(device=dev, repeat=1 if case["kind"] == "logprobs" or case["tokens"] > 8192 else repeat)
        need, what = 0, ""
        if case["kind"] == "attention" and case["method"] == "dense":
            need, what = case["heads"] * case["tokens"] ** 2 * 4 * 3, "dense attention matrices"  # scores, probabilities, their gradient; float32
        if case["kind"] == "logprobs" and case["method"] == "full logits":
            need, what = case["tokens"] * case["vocab"] * 4 * 3, "full logits"  # logits, log_softmax, their gradient; float32
        if need > args.max_gib * 2**30:
            rows.append({**case, "skipped": f"the {what} alone need {need / 2**30:.1f} GiB (> --max-gib {args.max_gib:g}; the machine has {_ram_gib():.0f} GiB)"})
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


def format_row(row: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    what = f"{row['kind']:<9} {row['method']:<16} N={row['tokens']:>6}"
    if "skipped" in row:
        return f"{what}  skipped: {row['skipped']}"
    base_method = "full logits" if row["kind"] == "logprobs" else "dense"
    base = next((r for r in rows if r["kind"] == row["kind"] and r["tokens"] == row["tokens"] and r["method"] == base_method and "seconds" in r), None)
    ratio = ""
    if base is not None and base is not row:
        ratio = f"  vs {base_method}: {_ratio(base['seconds'], row['seconds'], 'faster', 'slower')}, {_ratio(base['peak_bytes'], row['peak_bytes'], 'less memory', 'more memory')}"
    return f"{what} (packed {row['packed_tokens']}, naive {row['naive_tokens']})  {row['seconds'] * 1000:9.1f} ms  peak +{row['peak_bytes'] / 2**20:8.1f} MiB{ratio}"


if __name__ == "__main__":
    main()
