"""Step time of a deep workload on CPU: one tree with a long trunk and many short branches (≥ 50× compression), under a
token budget a quarter of the tree. Three ways to run the same step (forward + backward, same loss): the unsplit
forest in one micro-batch; the plain split (planMicroBatches without prefix reuse: every micro-batch repeats the
trunk); the step plan with prefix reuse (treepack.torch.run_step_plan). Plans come from the TypeScript planner
(`node dist/src/cli/main.js pack`), so this measures what a trainer would run. Prints one JSON line.

    OMP_NUM_THREADS=1 PYTHONPATH=python python bench/prefix_step.py [--branches 220] [--repeats 3] [--model qwen3_5]

``--model qwen3_5``: the same width with Gated DeltaNet layers (linear attention, full attention, twice), whose
cached segments hold convolution tails and recurrent states instead of keys/values.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
import transformers
import treepack.torch as tpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(trunk: int, branches: int, branch: int, vocab: int, seed: int = 0):
    r = random.Random(seed)
    stem = [r.randrange(vocab) for _ in range(trunk)]
    return [stem + [r.randrange(vocab) for _ in range(branch)] for _ in range(branches)]


def pack(seqs, out: str, max_tokens: int, prefix: bool):
    src = os.path.join(out, "in.jsonl")
    with open(src, "w") as f:
        for i, s in enumerate(seqs):
            f.write(json.dumps({"id": f"s{i}", "tokens": s, "group": "g", "advantages": [1.0 - 2.0 * (i % 2)] * len(s)}) + "\n")
    dest = os.path.join(out, "prefix" if prefix else "plain")
    args = [
        "node",
        os.path.join(ROOT, "dist", "src", "cli", "main.js"),
        "pack",
        src,
        "--out",
        dest,
        "--max-tokens",
        str(max_tokens),
        "--advantages",
        "none",
        "--quiet",
    ]
    if prefix:
        args += ["--prefix-reuse", str(1 << 30)]
    subprocess.run(args, check=True)
    manifest = tpt.read_manifest(dest)
    return manifest, [tpt.load_microbatch(os.path.join(dest, e["file"])) for e in manifest["micro_batches"]]


def model_of(vocab: int, family: str = "qwen3"):
    common = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            **common,
        )
        m = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    m.set_attn_implementation("treepack")
    return m.eval()


def loss_fn(lp, batch):
    occ = tpt.gather_occurrences(lp, batch)[batch.loss_mask]
    return -(batch.advantages[batch.loss_mask] * occ).sum()


def plain_step(model, batches):
    for b in batches:
        if b.num_nodes:
            loss_fn(tpt.packed_logprobs(model, b, attention="block").logprobs, b).backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trunk", type=int, default=960)
    ap.add_argument("--branches", type=int, default=220)
    ap.add_argument("--branch", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=("qwen3", "qwen3_5"), default="qwen3")
    a = ap.parse_args()
    vocab = 2048
    seqs = workload(a.trunk, a.branches, a.branch, vocab)
    naive = sum(len(s) for s in seqs)
    tree = a.trunk + a.branches * a.branch
    T = -(-tree // 4)
    model = model_of(vocab, a.model)
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(d + "/w")
        _, whole = pack(seqs, d + "/w", 1 << 30, False)
        plain_manifest, plain = pack(seqs, d, T, False)
        plan_manifest, planned = pack(seqs, d, T, True)
    runs = {
        "unsplit": lambda: plain_step(model, whole),
        "plain_split": lambda: plain_step(model, plain),
        "prefix_plan": lambda: tpt.run_step_plan(model, planned, loss_fn, attention="block"),
    }
    for fn in runs.values():  # warm-up
        model.zero_grad(set_to_none=True)
        fn()
    # Interleaved, best of `repeats` each: on a shared machine the others' load drifts over minutes.
    results = {name: float("inf") for name in runs}
    for _ in range(a.repeats):
        for name, fn in runs.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            results[name] = min(results[name], time.perf_counter() - t0)
    plain_tokens = sum(b.num_nodes for b in plain)
    print(
        json.dumps(
            {
                "model": a.model,
                "workload": {
                    "trunk": a.trunk,
                    "branches": a.branches,
                    "branch": a.branch,
                    "naive_tokens": naive,
                    "tree_tokens": tree,
                    "compression": naive / tree,
                    "max_tokens": T,
                },
                "micro_batches": {"plain_split": len(plain), "prefix_plan": len(planned)},
                "tokens_computed": {
                    "unsplit": tree,
                    "plain_split": plain_tokens,
                    "prefix_plan": plan_manifest["computed_tokens"],
                    "prefix_pushed": plan_manifest["pushed_tokens"],
                },
                "seconds": results,
                "vs_unsplit": {k: v / results["unsplit"] for k, v in results.items()},
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
