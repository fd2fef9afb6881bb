"""One GRPO step on prefix-tree packed micro-batches with a Hugging Face model, packed and unpacked.

    python examples/grpo_step.py                          # generated GRPO groups, random-weight Qwen3
    python examples/grpo_step.py --data rollouts.jsonl --max-tokens 8192 --model ~/models/Qwen3-0.6B

1. pack the JSONL with the treepack CLI (``treepack pack --out DIR``; GRPO advantages from each group's rewards);
2. load the first micro-batch (``PackedDataset``, manifest order);
3. old logprobs from a no-grad packed forward (the policy before the update), when the data has none;
4. packed step: forward with tree attention, logprobs only where trainable tokens are predicted, PackedLoss,
   backward, AdamW step; then the same step on the unpacked batch (every sequence its own chain) from the same
   weights. Prints both losses (equal up to float32 rounding) and step times.

Needs torch and transformers (``node scripts/python-env.mjs`` makes a .venv with them) and the built CLI
(``npm install``). Without --model the model is a small random-weight Qwen3 whose vocabulary covers the data.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The installed package (`pip install ./python`) when there is one, else this checkout's sources.
if importlib.util.find_spec("treepack") is None:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import transformers  # noqa: E402
import treepack.torch as tpt  # noqa: E402  (registers attn_implementation "treepack")


def generated_groups(path: str, groups: int = 2, size: int = 6, vocab: int = 512, seed: int = 0) -> None:
    """GRPO-shaped pre-tokenized samples: per group one prompt and `size` completions sharing prefixes, a reward each."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for g in range(groups):
            prompt = [r.randrange(vocab) for _ in range(r.randrange(100, 200))]
            stems = [[r.randrange(vocab) for _ in range(r.randrange(5, 40))] for _ in range(2)]
            for i in range(size):
                completion = r.choice(stems) + [r.randrange(vocab) for _ in range(r.randrange(10, 60))]
                tokens = prompt + completion
                mask = [0] * len(prompt) + [1] * len(completion)
                f.write(
                    json.dumps(
                        {"id": f"g{g}-{i}", "group": f"g{g}", "tokens": tokens, "loss_mask": mask, "reward": float(r.random() < 0.5)}
                    )
                    + "\n"
                )


def pack(data: str, out: str, max_tokens: int) -> None:
    cli = os.path.join(ROOT, "dist", "src", "cli", "main.js")
    if not os.path.exists(cli):
        sys.exit(f"{cli} not found: run `npm install` (it builds the CLI) first")
    subprocess.run(["node", cli, "pack", data, "--out", out, "--max-tokens", str(max_tokens), "--quiet"], check=True)


def make_model(path: str | None, vocab: int) -> torch.nn.Module:
    if path:
        return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="treepack", dtype=torch.float32)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    model.set_attn_implementation("treepack")
    return model


def step(model: torch.nn.Module, batch: tpt.PackedBatch, config: dict) -> tuple[float, dict, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t0 = time.perf_counter()
    lp = tpt.packed_logprobs(model, batch).logprobs
    loss, metrics = tpt.packed_loss(lp, batch, config)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach()), metrics, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="JSONL rollouts (any format `treepack pack` reads); default: generated GRPO groups")
    ap.add_argument("--model", help="a local Hugging Face checkpoint; default: random-weight Qwen3")
    ap.add_argument("--max-tokens", type=int, default=4096, help="packed tokens per micro-batch")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    config = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean"}

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or os.path.join(tmp, "rollouts.jsonl")
        if not args.data:
            generated_groups(data)
        pack(data, os.path.join(tmp, "packed"), args.max_tokens)
        dataset = tpt.PackedDataset(os.path.join(tmp, "packed"))
        batch = next(iter(dataset))

    model = make_model(args.model, vocab=max(512, int(batch.input_ids.max()) + 1))
    if batch.old_logprobs is None:
        with torch.no_grad():
            old = tpt.packed_logprobs(model, batch).logprobs
        batch.old_logprobs = tpt.gather_occurrences(old, batch).float()
    baseline = copy.deepcopy(model)
    naive = tpt.naive_batch(batch)

    loss_p, metrics, time_p = step(model, batch, config)
    loss_u, _, time_u = step(baseline, naive, config)
    drift = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), baseline.parameters()))
    result = {
        "micro_batches": len(dataset),
        "sequences": batch.num_sequences,
        "naive_tokens": batch.num_occurrences,
        "packed_tokens": batch.num_nodes,
        "loss_packed": loss_p,
        "loss_unpacked": loss_u,
        "step_seconds_packed": time_p,
        "step_seconds_unpacked": time_u,
        "speedup": time_u / time_p,
        "max_weight_difference_after_step": drift,
        "metrics": metrics,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"micro-batch 1 of {len(dataset)}: {batch.num_sequences} sequences, {batch.num_occurrences} naive → {batch.num_nodes} packed tokens"
    )
    print(f"packed:   loss {loss_p:.6f}  step {time_p * 1000:.0f} ms")
    print(f"unpacked: loss {loss_u:.6f}  step {time_u * 1000:.0f} ms  ({time_u / time_p:.2f}x the packed step)")
    print(f"weights after the step differ by at most {drift:.2e}; clipfrac {metrics['clipfrac_high'] + metrics['clipfrac_low']:.3f}")


if __name__ == "__main__":
    main()
