"""One rank of test_stepplan.DataParallelStepPlanTest (gloo, CPU): its planned micro-batches through ``run_step_plan``
on a DistributedDataParallel model, against (a) the unsplit forest of every rank's sequences run in one process,
its gradient divided by the world size as DDP averages, and (b) plain DDP: the same micro-batches run in full
through DDP's own forward, gradients accumulated under ``no_sync()`` and synchronised by the last backward. Writes
the largest differences to OUT/rank{r}.json."""

from __future__ import annotations

import json
import os
import random

from support import tiny_model, torch, tpt
from test_stepplan import VOCAB, assemble, chain_of, loss_fn, occurrence_data, plan_ops, sorted_groups


def scenario(name: str):
    """Every rank's sequences and its micro-batches: (sequences, {rank: (groups, hangs)})."""
    r = random.Random(11)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(14)
    mid = stem + tok(5)
    seqs = [mid + tok(3), mid + tok(4), mid[:-2] + tok(3), stem + tok(6), stem + tok(2), stem[:6] + tok(4), tok(5), mid + tok(2)]
    order = sorted_groups(seqs, [1] * len(seqs))
    if name == "split":
        # The stem's branches over both ranks: each rank pushes the stem (and rank 0 the longer mid) for its own.
        ranks = {0: [order[0] + order[1], order[2], order[3]], 1: [order[4], order[5] + order[6], order[7]]}
    else:  # "idle": rank 1 has only an empty micro-batch (ranks padded to equal steps)
        ranks = {0: [order[0] + order[1], order[2] + order[3], order[4] + order[5], order[6] + order[7]], 1: []}
    return seqs, ranks


def hangs_of(seqs, groups):
    """Each micro-batch hangs from the prefix its first sequence shares with the previous micro-batch's."""
    out = []
    for m, g in enumerate(groups):
        prev = seqs[groups[m - 1][0]] if m else []
        cur = seqs[g[0]]
        out.append(next((i for i, (x, y) in enumerate(zip(prev, cur)) if x != y), min(len(prev), len(cur))))
    return out


def worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=world)
    try:
        report = {}
        for name in ("split", "idle"):
            seqs, ranks = scenario(name)
            data = occurrence_data(seqs, seed=4)
            model = tiny_model("qwen3", torch.float64, vocab=VOCAB)  # the same seed: the same weights on every rank
            ddp = torch.nn.parallel.DistributedDataParallel(model)

            # (a) every rank's sequences unsplit, in this one process, averaged as DDP averages.
            whole = assemble(seqs, data, range(len(seqs)))
            loss_fn(tpt.packed_logprobs(model, whole, attention="block").logprobs, whole).backward()
            unsplit = {n: p.grad / world for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)

            groups = ranks[rank]
            batches = [assemble(seqs, data, g) for g in groups]
            ops = [tpt.StepOp(*o) for o in plan_ops([chain_of(b, h) for b, h in zip(batches, hangs_of(seqs, groups))])]
            if not batches:
                from treepack.pack import pack_sequences

                batches, ops = [tpt.from_microbatch(pack_sequences([]))], [tpt.StepOp(0, [], 0)]

            # The plan without the all-reduce: each rank holds only its own part (the control).
            res = tpt.run_step_plan(ddp, batches, loss_fn, ops, attention="block", block_size=4, sync=False)
            alone = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            res = tpt.run_step_plan(ddp, batches, loss_fn, ops, attention="block", block_size=4)
            planned = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)

            # (b) plain DDP: each micro-batch in full through DDP's forward; the last backward synchronises (every rank
            # must run a forward for that: not with an idle rank).
            plain = None
            if name == "split":
                for i, b in enumerate(batches):
                    sync = i == len(batches) - 1
                    with torch.enable_grad() if sync else ddp.no_sync():
                        loss_fn(tpt.forward_logprobs(ddp, b, attention="block").logprobs, b).backward()
                plain = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)

            diff = lambda a, b: max(float((a[n] - b[n]).abs().max()) for n in a)  # noqa: E731
            report[name] = {
                "unsplit_diff": diff(planned, unsplit),
                "plain_ddp_diff": None if plain is None else diff(planned, plain),
                "unsynced_diff": diff(alone, unsplit),
                "pushed_tokens": res.pushed_tokens,
                "grad_scale": max(float(g.abs().max()) for g in unsplit.values()),
            }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()
