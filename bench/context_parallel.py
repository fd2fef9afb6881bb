"""Context parallelism on CPU: one long tree split over K gloo ranks against the same tree on one rank.

    python bench/context_parallel.py                       # 4 ranks, a tree of 131,072 tokens, tiny Qwen3, float32
    python bench/context_parallel.py --ranks 2 --prompt 512 --branches 7 --branch 512 --window 256   # npm run bench's

The tree: a prompt of ``--prompt`` tokens and ``--branches`` answers of ``--branch`` tokens hanging from it. One
training step (``packed_logprobs``, ``packed_loss``, backward) runs once on one rank and once split over the ranks
(``treepack.torch.context_parallel``, spawned processes, one thread each). Measured per rank: tokens computed, context
tokens (ancestors whose keys/values it fetched), bytes the exchanges moved (forward all-gathers received, backward
all-reduces), the bytes autograd saved for backward (saved-tensor hooks; parameters excluded, each storage counted
once: the activation memory of the step) and the step's wall time. Printed as one JSON line; K/V bytes are the
whole row's keys and values over all layers, for comparison with the bytes exchanged. With ``--window W`` the first
layer is a sliding-window layer of window W (the second full): it fetches only the context keys within W positions
of a local query, and each rank also counts what a forward fetching the whole context for every layer would receive
(``received_bytes_whole``). ``npm run bench`` runs it (bench/context-parallel.ts): a small tree over 2 ranks by
default, this default with ``--full``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("treepack") is None:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import treepack.torch as tpt  # noqa: E402

CONFIG = {"clip_low": 0.2, "clip_high": 0.28}


def model(dtype: torch.dtype, window: int) -> torch.nn.Module:
    layers = ["sliding_attention", "full_attention"]
    sliding = {"use_sliding_window": True, "sliding_window": window, "layer_types": layers} if window else {}
    cfg = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        **sliding,
    )
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()
    m.set_attn_implementation("treepack")
    return m


def tree(prompt: int, branches: int, branch: int) -> tpt.PackedBatch:
    """The packed forest, built directly: the prompt chain, then each answer chain hanging from its last node."""
    rng = np.random.default_rng(0)
    N = prompt + branches * branch
    parent = np.arange(-1, N - 1, dtype=np.int64)
    subtree_end = np.full(N, N, dtype=np.int64)
    position = np.arange(N, dtype=np.int64)
    for b in range(branches):
        a = prompt + b * branch
        parent[a] = prompt - 1
        subtree_end[a : a + branch] = a + branch
        position[a : a + branch] = prompt + np.arange(branch)
    seq_positions = np.concatenate([np.concatenate([np.arange(prompt), prompt + b * branch + np.arange(branch)]) for b in range(branches)])
    L = prompt + branch
    t = torch.from_numpy
    M = branches * L
    return tpt.PackedBatch(
        input_ids=t(rng.integers(1, 256, N)),
        position_ids=t(position),
        parent=t(parent),
        subtree_end=t(subtree_end),
        seq_offsets=t(np.arange(branches + 1, dtype=np.int64) * L),
        seq_positions=t(seq_positions),
        loss_mask=t(np.tile(np.arange(L) >= prompt, branches)),
        seq_index=t(np.repeat(np.arange(branches, dtype=np.int64), L)),
        token_index=t(np.tile(np.arange(L, dtype=np.int64), branches)),
        meta={"num_tokens_packed": N},
        advantages=t(rng.standard_normal(M).astype(np.float32)),
        old_logprobs=t((-rng.random(M) * 3 - 3).astype(np.float32)),
    )


def measured_step(m: torch.nn.Module, batch: tpt.PackedBatch) -> tuple[int, float]:
    """(bytes saved for backward, parameters excluded; seconds of forward, loss and backward)."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        s = x.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return x

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp = tpt.packed_logprobs(m, batch).logprobs
        loss, _ = tpt.packed_loss(lp, batch, CONFIG, validate=False)
    loss.backward()
    return sum(seen.values()), time.perf_counter() - start


def worker(rank: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=args.ranks, timeout=datetime.timedelta(seconds=600)
    )
    batch = tree(args.prompt, args.branches, args.branch)
    m = model(torch.float32, args.window)
    cp = tpt.ContextParallel.of(batch)
    local = tpt.split_batch(batch, cp)
    dist.barrier()
    saved, seconds = measured_step(m, local)
    part = local.context_parallel
    whole = None
    if args.window:
        from treepack.torch.context_parallel import LocalPart

        # The same forward with every layer fetching the whole context: the bytes the window routes save.
        again = tpt.split_batch(batch, cp, check=False)
        real, LocalPart.window_route = LocalPart.window_route, lambda self, window: None
        try:
            with torch.no_grad():
                tpt.packed_logprobs(m, again)
        finally:
            LocalPart.window_route = real
        whole = again.context_parallel.stats.get("received_bytes", 0)
    row = {
        "tokens": cp.hi - cp.lo,
        "context_tokens": part.rows,
        "saved_bytes": saved,
        "seconds": seconds,
        "received_bytes": part.stats.get("received_bytes", 0),
        "sent_bytes": part.stats.get("sent_bytes", 0),
        "reduced_bytes": part.stats.get("reduced_bytes", 0),
        "received_bytes_whole": whole,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--branches", type=int, default=127)
    ap.add_argument("--branch", type=int, default=1024)
    ap.add_argument("--window", type=int, default=0, help="make layer 0 a sliding-window layer of this window (0: none)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(args, out), nprocs=args.ranks, join=True, start_method="spawn")
        ranks = []
        for r in range(args.ranks):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    batch = tree(args.prompt, args.branches, args.branch)
    m = model(torch.float32, args.window)
    one_saved, one_seconds = measured_step(m, batch)
    cfg = m.config
    kv_bytes = batch.num_nodes * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * 4
    N = batch.num_nodes
    print(
        json.dumps(
            {
                "tokens": N,
                "ranks": args.ranks,
                "window": args.window or None,
                "one_rank": {"saved_bytes": one_saved, "seconds": one_seconds},
                "per_rank": ranks,
                "token_share_max_over_ideal": max(r["tokens"] for r in ranks) / (N / args.ranks),
                "saved_share": [r["saved_bytes"] / one_saved for r in ranks],
                "kv_bytes_whole_row": kv_bytes,
                "step_seconds_max_rank_over_one_rank": max(r["seconds"] for r in ranks) / one_seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
