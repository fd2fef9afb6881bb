"""One training step of a prefix tree split over a context-parallel group, checked against the one-rank run.

    torchrun --nproc-per-node 2 examples/context_parallel.py        # K = 2, 3, 4 ... ranks, gloo on CPU

Every rank builds the same tiny random-weight Qwen3 (float64; a sliding-window layer and a full one) and packs the
same tree: a shared prompt, GRPO groups of answers branching from it and from each other. The row is split over the
ranks (``treepack.torch.context_parallel``: bounds balanced by the work the tree mask gives each row); each rank runs
``packed_logprobs`` and ``packed_loss`` on its local part (keys/values exchanged in every attention layer, the loss
normalised by the whole row's counts), back-propagates, sums the gradients over the group and takes an SGD step.
Every rank also runs the whole row alone from the same weights. Rank 0 prints, as its last line, JSON with the
largest differences of logprobs, loss, gradients and updated weights between the two (float64: ~1e-16).

Needs torch and transformers (``node scripts/python-env.mjs`` makes a .venv with them) and the treepack wheel or
this checkout's sources with the built C core.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("treepack") is None:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
import treepack  # noqa: E402
import treepack.torch as tpt  # noqa: E402  (registers attn_implementation "treepack")

VOCAB = 128
CONFIG = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "seq-mean-token-mean", "kl": "k3", "kl_coef": 0.05}


def tree(seed: int = 0) -> tpt.PackedBatch:
    """A prompt of 40 tokens, 3 groups of 4 answers (each group sharing a first turn), trainable answers only."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
    prompt = tok(40)
    seqs, prompt_lens = [], []
    for _ in range(3):
        turn = prompt + tok(r.randrange(8, 16))
        for _ in range(4):
            seqs.append(turn + tok(r.randrange(6, 20)))
            prompt_lens.append(len(prompt))
    mb = treepack.pack_sequences(seqs)
    rng = np.random.default_rng(seed)
    M = len(mb.seq_positions)
    offsets = np.asarray(mb.seq_offsets)
    t = np.arange(M) - np.repeat(offsets[:-1], np.diff(offsets))
    mb.loss_mask = (t >= np.repeat(prompt_lens, np.diff(offsets))).astype(np.uint8)
    rewards = rng.standard_normal(len(seqs))
    mb.advantages = np.repeat(rewards - rewards.mean(), np.diff(offsets)).astype(np.float32)
    mb.old_logprobs = (-rng.random(M) * 3 - 2).astype(np.float32)
    mb.ref_logprobs = (-rng.random(M) * 3 - 2).astype(np.float32)
    return tpt.from_microbatch(mb)


def model() -> torch.nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        sliding_window=24,
        use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    m.set_attn_implementation("treepack")
    return m


def step(m: torch.nn.Module, batch: tpt.PackedBatch, cp: tpt.ContextParallel | None) -> tuple[torch.Tensor, float, list[torch.Tensor]]:
    """Logprobs [N], the loss (the whole row's) and the gradients, then one SGD step; with ``cp``, on this rank's part."""
    m.zero_grad(set_to_none=True)
    lp = tpt.packed_logprobs(m, batch).logprobs
    loss, metrics = tpt.packed_loss(lp, batch, CONFIG)
    loss.backward()
    if cp is not None:
        tpt.reduce_gradients(m, cp)
    grads = [p.grad.clone() for p in m.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.5 * p.grad
    return lp.detach(), metrics["loss"], grads


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = tree()
    one_model, cp_model = model(), model()
    lp, loss, grads = step(one_model, batch, None)

    cp = tpt.ContextParallel.of(batch)
    local = tpt.split_batch(batch, cp)
    local_lp, local_loss, local_grads = step(cp_model, local, cp)

    A = local.context_parallel.rows
    nan = lambda x: torch.nan_to_num(x, nan=0.0)  # noqa: E731  (NaN where not scored, in both)
    diffs = torch.tensor(
        [
            float((nan(lp[cp.lo : cp.hi]) - nan(local_lp[A:])).abs().max()),
            abs(loss - local_loss),
            max(float((a - b).abs().max()) for a, b in zip(grads, local_grads)),
            max(float((a - b).detach().abs().max()) for a, b in zip(one_model.parameters(), cp_model.parameters())),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    stats = torch.tensor([cp.hi - cp.lo, A, local.context_parallel.stats.get("received_bytes", 0)], dtype=torch.float64)
    every = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(every, stats)
    if rank == 0:
        print(
            json.dumps(
                {
                    "ranks": world,
                    "tokens": batch.num_nodes,
                    "rank_tokens": [int(s[0]) for s in every],
                    "rank_context_tokens": [int(s[1]) for s in every],
                    "rank_received_bytes": [int(s[2]) for s in every],
                    "loss": loss,
                    "max_diff_logprobs": diffs[0].item(),
                    "max_diff_loss": diffs[1].item(),
                    "max_diff_gradients": diffs[2].item(),
                    "max_diff_weights_after_step": diffs[3].item(),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
