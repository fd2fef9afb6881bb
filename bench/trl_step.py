"""TRL's GRPO step, stock forward vs treepack's packed forward (treepack.integrations.trl), on the step bench's agent
workloads: every LLM call a TRL row (prompt = the tokens before its first trainable one, completion the rest), the
same rows on both sides, TRL's own loss (``dapo``, per-token
advantages and old logprobs from the micro-batch) over one optimizer step of gradient accumulation.

- stock:  ``GRPOTrainer.compute_loss`` on the padded rows (left-padded prompts, right-padded completions) in
  micro-batches of at most the budget's padded tokens, SDPA;
- packed: ``TreepackGRPOTrainer.compute_loss`` on the rows of the packer's micro-batches (forests within the
  budget), packed into a forest inside the trainer (its packing, mask and scatter timed with it), tree attention.

Both must give the same loss (the step's sum); a disagreement is reported. Timed interleaved, best of the repeats;
peak memory of the largest micro-batch (bench/step.py peak_of).

    python bench/trl_step.py SPEC.json   # spec written by bench/trl-step.ts; prints one JSON object on stdout
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from step import _sequences, make_model, peak_of, sync, tpt, with_old_logprobs  # noqa: E402  (also puts python/ on the path)
from treepack.integrations.trl import TreepackGRPOTrainer  # noqa: E402

SIDES = ("stock", "packed")
ATTENTION = {"stock": "sdpa", "packed": "treepack"}


def tokenizer(vocab: int):
    """A WordLevel tokenizer over the model's ids (TRL wants one for its pad id; nothing is decoded into the loss)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t0", unk_token="t0")


def trl_inputs(batch: tpt.PackedBatch, num_items: int) -> dict[str, Any]:
    rows, layout = tpt.padded_rows(batch, 0)
    out = {k: rows[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    out.update(
        tool_mask=rows["loss_mask"],
        num_items_in_batch=torch.tensor(num_items, device=batch.device),
        advantages=layout.to_padded(batch.advantages, of="occurrences", where="all"),
        old_per_token_logps=layout.to_padded(batch.old_logprobs, of="occurrences", where="all"),
    )
    return out


def row_chunks(batch: tpt.PackedBatch, max_tokens: int) -> list[tpt.PackedBatch]:
    """A micro-batch's sequences, in order, as TRL micro-batches of at most ``max_tokens`` padded tokens (rows × the
    longest prompt + the longest completion; a longer row alone): what a stock TRL run sizes its batches by."""
    naive = tpt.naive_batch(batch)
    lengths = (naive.seq_offsets[1:] - naive.seq_offsets[:-1]).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        a = int(naive.seq_offsets[i])
        hit = torch.nonzero(naive.loss_mask[a : a + n]).flatten()
        prompts.append(int(hit[0]) if hit.numel() else n)
    out, start = [], 0
    for end in range(1, len(lengths) + 1):
        P, C = max(prompts[start:end]), max(n - p for n, p in zip(lengths[start:end], prompts[start:end]))
        if end - start > 1 and (end - start) * (P + C) > max_tokens:
            out.append(_sequences(naive, start, end - 1))
            start = end - 1
    out.append(_sequences(naive, start, len(lengths)))
    return out


def trainers(model: torch.nn.Module, vocab: int, out_dir: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out_dir,
        loss_type="dapo",
        beta=0.0,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=2,
        num_generations=2,
        bf16=False,
        disable_tqdm=True,
    )
    common = dict(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t1"] * 2}),
        processing_class=tokenizer(vocab),
    )
    ts = {"stock": GRPOTrainer(**common), "packed": TreepackGRPOTrainer(**common)}
    for t in ts.values():  # what Trainer's loop sets before compute_loss; dapo's normaliser reads it
        t.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return ts


def step(t: Any, side: str, model: torch.nn.Module, inputs: list[dict[str, Any]], device: torch.device) -> dict[str, float]:
    """One optimizer step's forward + backward (TRL's compute_loss per micro-batch), timed."""
    model.set_attn_implementation(ATTENTION[side])
    model.zero_grad(set_to_none=True)
    sync(device)
    t0 = time.perf_counter()
    loss = 0.0
    for x in inputs:
        value = t.compute_loss(model, x)
        value.backward()
        loss += float(value.detach())
    sync(device)
    return {"step": time.perf_counter() - t0, "loss_value": loss}


def run_workload(w: dict[str, Any], shape: dict[str, Any], device: torch.device, dtype: torch.dtype, out_dir: str) -> dict[str, Any]:
    batches = list(tpt.PackedDataset(w["calls_dir"]))
    vocab = torch.unique(torch.cat([b.input_ids for b in batches]))
    batches = [with_old_logprobs(b, vocab).to(device) for b in batches]
    num_items = sum(int(b.loss_mask.sum()) for b in batches)
    # The packed side takes the packer's micro-batches (forests within the budget); the stock side the same rows in
    # micro-batches within the budget of padded tokens. dapo divides by the step's tokens: the same loss either way.
    inputs = {
        "packed": [trl_inputs(b, num_items) for b in batches],
        "stock": [trl_inputs(c, num_items) for b in batches for c in row_chunks(b, w["max_tokens"])],
    }
    model = make_model(shape, int(vocab.numel()), device, dtype)
    ts = trainers(model, int(vocab.numel()), out_dir)

    def size(x: dict[str, Any]) -> int:
        return x["prompt_ids"].numel() + x["completion_ids"].numel()

    largest = {k: max(v, key=size) for k, v in inputs.items()}
    for k in SIDES:  # warm-up on the largest micro-batch
        step(ts[k], k, model, [largest[k]], device)
    ts["packed"].treepack_stats.clear()
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in SIDES}
    for _ in range(w["repeats"]):
        for k in SIDES:
            runs[k].append(step(ts[k], k, model, inputs[k], device))
    packed_nodes = sum(n for _, n in ts["packed"].treepack_stats[: len(inputs["packed"])])
    naive = sum(b.num_occurrences for b in batches)
    padded = sum(size(x) for x in inputs["stock"])
    sides = {}
    for k in SIDES:
        best = min(runs[k], key=lambda r: r["step"])
        peak = peak_of(functools.partial(step, ts[k], k, model, [largest[k]], device), model, device)
        sides[k] = {
            **best,
            "steps": [r["step"] for r in runs[k]],
            "peak_bytes": peak,
            "tokens_per_second": naive / best["step"],
            "micro_batches": len(inputs[k]),
        }
    a, b = sides["stock"]["loss_value"], sides["packed"]["loss_value"]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    mismatch = abs(a - b) > tol * max(1.0, abs(a))
    return {
        "name": w["name"],
        "input": w["input"],
        "shape": shape,
        "naive_tokens": naive,
        "padded_tokens": padded,
        "packed_tokens": packed_nodes,
        "trainable_tokens": num_items,
        "vocab": int(vocab.numel()),
        "sides": sides,
        "mismatch": f"loss {b} packed vs {a} stock" if mismatch else None,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    shape = spec["shapes"][device.type][0]
    results = []
    for i, w in enumerate(spec["workloads"]):
        if device.type not in w["devices"]:
            results.append({"name": w["name"], "input": i, "skipped": f"timed on {' and '.join(w['devices'])} hosts only"})
            continue
        t0 = time.perf_counter()
        try:
            r = run_workload({**w, "input": i}, shape, device, dtype, spec["out_dir"])
        except torch.cuda.OutOfMemoryError as e:
            r = {"name": w["name"], "input": i, "skipped": f"out of GPU memory: {str(e).splitlines()[0]}"}
        results.append(r)
        took = ", ".join(f"{k} {r['sides'][k]['step']:.2f} s" for k in SIDES) if "sides" in r else r["skipped"]
        print(
            f"  TRL step [{i + 1}/{len(spec['workloads'])}] {w['name']}: best of {w['repeats']}: {took}; "
            f"took {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    import trl

    print(
        json.dumps(
            {
                "device": name,
                "device_type": device.type,
                "dtype": str(dtype).replace("torch.", ""),
                "torch": torch.__version__,
                "trl": trl.__version__,
                "shape": shape,
                "workloads": results,
            }
        )
    )


if __name__ == "__main__":
    main()
