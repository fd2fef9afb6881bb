"""A packed-vs-naive training step on an agent-like workload, for scripts/gpu-check.sh: the timing and the equality
check are bench/step.py's (``run_layouts``), the workload is generated here in Python (no node on a GPU host).

    python scripts/gpu_check/train_step.py --tokens 8192 --json OUT.json            # Qwen3-0.6B shape, bf16, CUDA
    python scripts/gpu_check/train_step.py --tokens 512 --shape tiny --device cpu   # the dry run's CPU proof

The workload: one GRPO group of episodes that share a long system prompt; each episode is a chain of turns (an
assistant response, then a tool's output), and every LLM call is its own sequence: the prompt, the episode's history
so far and the call's response, the response alone trainable. The naive side trains every call as its own sequence
(whole calls in order, under the token budget); the packed side trains the calls' prefix tree. Every micro-batch of
both sides is padded to the budget (one length for the compiled attention in the whole run). Prints one ``SUMMARY:`` line
(the figures scripts/gpu-check.sh puts in its summary) and exits 1 when the sides disagree or the step fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import treepack  # noqa: E402
import treepack.torch as tpt  # noqa: E402


def _bench_step() -> Any:
    """bench/step.py as a module (bench/ is no package: it is loaded by its path)."""
    spec = importlib.util.spec_from_file_location("bench_step", os.path.join(ROOT, "bench", "step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step = _bench_step()

# Qwen3-0.6B's config.json (bench/cost-model.ts QWEN3_SHAPES[0]); tiny: bench/step.ts CPU_SHAPE, for the dry run.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "name": "Qwen3-0.6B",
        "hidden": 1024,
        "intermediate": 3072,
        "layers": 28,
        "heads": 16,
        "kv_heads": 8,
        "head_dim": 128,
        "vocab": 151936,
    },
    "tiny": {
        "name": "tiny Qwen3 shape",
        "hidden": 128,
        "intermediate": 384,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "vocab": 1024,
    },
}

# Dense bf16 tensor-core peaks (NVIDIA's data sheets: half their with-sparsity figures), matched in this order against
# torch's device name: the PCIe and NVL parts first, then the SXM ones.
# One table for the bench's report and this script (bench/cost-model.ts reads it too).
with open(os.path.join(ROOT, "bench", "device-peaks.json")) as f:
    PEAKS = [(re.compile(p["match"], re.I), p["name"], float(p["flops"])) for p in json.load(f)["peaks"]]


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The peak MFU divides by, and where it comes from; None where this device and dtype have no entry."""
    if device.type != "cuda":
        return None, "unknown (CPU)"
    name = torch.cuda.get_device_name(device)
    for match, key, peak in PEAKS:
        if match.search(name) and dtype in (torch.bfloat16, torch.float16):
            return peak, f"{peak / 1e12:.0f} TFLOP/s ({key} bf16/fp16 dense, bench/device-peaks.json)"
    return None, f"unknown ({name}, {str(dtype).replace('torch.', '')})"


def agent_workload(budget: int, vocab: int, seed: int, episodes: int = 8, turns: int = 4) -> dict[str, Any]:
    """One group's calls (sequences), their loss masks and per-call advantages, sized so the packed forest fills
    ~94% of ``budget``: a prompt of 3/8 of it, then ``episodes`` × ``turns`` turns of response + tool output."""
    r = np.random.default_rng(seed)
    prompt_len = budget * 3 // 8
    turn = (budget - prompt_len) * 15 // (16 * episodes * turns)
    response = max(2, turn * 4 // 9)
    tool = max(1, turn - response)
    tok = lambda n: r.integers(1, vocab, n).tolist()  # noqa: E731  (0 is the pad token)
    prompt = tok(prompt_len)
    reward = r.standard_normal(episodes)
    reward[0] = abs(reward[0]) + 1  # never all equal: zero advantages would make the equality check vacuous
    advantage = (reward - reward.mean()) / reward.std()
    seqs, masks, adv = [], [], []
    for e in range(episodes):
        history = list(prompt)
        for _ in range(turns):
            out = tok(response)
            seqs.append(history + out)
            masks.append([0] * len(history) + [1] * len(out))
            adv.append(float(advantage[e]))
            history = history + out + tok(tool)
    return {"sequences": seqs, "loss_masks": masks, "advantages": adv}


def layouts(w: dict[str, Any], budget: int) -> dict[str, list[tpt.PackedBatch]]:
    """The naive and packed sides' micro-batches (CPU tensors, not yet padded) of a workload under ``budget``."""
    seqs, masks, adv = w["sequences"], w["loss_masks"], w["advantages"]
    plan = treepack.plan_micro_batches(seqs, max_tokens=budget, loss_masks=masks)
    packed = []
    for mb in plan.micro_batches:
        idx = mb.sequences.tolist()
        packed.append(
            tpt.from_microbatch(
                treepack.pack_sequences([seqs[i] for i in idx], loss_mask=[masks[i] for i in idx], advantages=[adv[i] for i in idx])
            )
        )
    naive = step.chains_under_budget([tpt.naive_batch(b) for b in packed], budget)
    return {"naive": naive, "packed": packed}


def report(result: dict[str, Any], peak: float | None, peak_label: str) -> dict[str, Any]:
    """The figures of one timed result: per side the best step, tokens/s and MFU; the speedup; the sides' Δ."""
    figs, sides = result["figures"], result["sides"]
    out: dict[str, Any] = {"peak": peak_label, "sides": {}}
    for k in ("naive", "packed"):
        s, f = sides[k], figs[k]
        flops = step.model_flops(f, result["shape"], result["vocab"])
        out["sides"][k] = {
            "step_s": s["step"],
            "steps_s": s["steps"],
            "micro_batches": f["micro_batches"],
            "tokens": f["tokens"],
            "pad_tokens": f["pad_tokens"],
            "occurrences": f["occurrences"],
            "trainable": f["trainable"],
            "model_flops": flops,
            # Throughput of what the step trains (every call's tokens) and of what it computes (real nodes).
            "trained_tokens_per_s": f["occurrences"] / s["step"],
            "computed_tokens_per_s": (f["tokens"] - f["pad_tokens"]) / s["step"],
            "mfu": None if peak is None else flops / s["step"] / peak,
            "peak_bytes": s["peak_bytes"],
            "loss": s["loss_value"],
            "logprob_sum": s["logprob_sum"],
            "grad_norm": s["grad_norm"],
        }
    n, p = out["sides"]["naive"], out["sides"]["packed"]
    out["speedup"] = n["step_s"] / p["step_s"]
    out["flop_ratio"] = n["model_flops"] / p["model_flops"]  # the speedup at equal MFU on both sides
    out["compression"] = n["occurrences"] / (p["tokens"] - p["pad_tokens"])
    # The pass criterion is bench/step.py's agree(), applied in run_layouts; these are the figures.
    out["delta"] = {
        k: {"abs": abs(n[k] - p[k]), "rel": abs(n[k] - p[k]) / max(abs(n[k]), abs(p[k]), 1e-12)}
        for k in ("loss", "logprob_sum", "grad_norm")
    }
    return out


def summary_line(budget: int, shape: dict[str, Any], dtype: torch.dtype, r: dict[str, Any]) -> str:
    n, p, d = r["sides"]["naive"], r["sides"]["packed"], r["delta"]
    mfu = lambda s: "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"  # noqa: E731
    return (
        f"{budget} tokens, {shape['name']} {str(dtype).replace('torch.', '')}: compression {r['compression']:.1f}x; "
        f"naive {n['step_s']:.3f} s ({n['micro_batches']} mb), packed {p['step_s']:.3f} s ({p['micro_batches']} mb): speedup "
        f"{r['speedup']:.1f}x (model FLOP ratio {r['flop_ratio']:.1f}x); "
        f"trained tok/s naive {n['trained_tokens_per_s']:.0f} packed {p['trained_tokens_per_s']:.0f}; "
        f"MFU naive {mfu(n)} packed {mfu(p)} (peak {r['peak']}); |Δ| loss {d['loss']['abs']:.3g} (rel {d['loss']['rel']:.2g}), "
        f"grad-norm {d['grad_norm']['abs']:.3g} (rel {d['grad_norm']['rel']:.2g})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, required=True, help="the micro-batch budget every micro-batch is padded to")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, help="override the shape's layer count (a shallow exactness run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"SUMMARY: no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda})")
        return 1
    shape = dict(SHAPES[a.shape])
    if a.layers:
        shape.update(layers=a.layers, name=f"{shape['name']} at {a.layers} layers")
    w = agent_workload(a.tokens, shape["vocab"], a.seed)
    [result] = step.run_layouts(
        {"name": "agent group", "input": 0, "repeats": a.repeats},
        layouts(w, a.tokens),
        [shape],
        device,
        dtype,
        step.chain_attention(device, "stock"),
        vocab_size=shape["vocab"],
        pad=a.tokens,
    )
    out: dict[str, Any] = {
        "budget": a.tokens,
        "shape": shape,
        "dtype": a.dtype,
        "device": str(device),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    ok = "sides" in result and not result.get("mismatches")
    if "sides" in result:
        out.update(report(result, *peak_flops(device, dtype)))
        out["mismatches"] = result.get("mismatches", {})
        line = summary_line(a.tokens, shape, dtype, out)
        if result.get("mismatches"):
            line += "; MISMATCH " + "; ".join(f"{k}: {', '.join(v)}" for k, v in result["mismatches"].items())
    else:
        out["error"] = result.get("error") or result.get("skipped")
        line = f"{a.tokens} tokens: {out['error']}"
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"SUMMARY: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
