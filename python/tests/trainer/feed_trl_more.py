"""TRL on ``treepack serve`` beyond one plain rank (feed_trl.py's helpers; called by test/serve-trl.test.ts):

    python feed_trl_more.py ddp SPEC.json    two processes (gloo, CPU, DDP through accelerate), each TRL on its own
                                             ``FeedClient(url, rank=r, dp=2)`` from ``treepack serve --dp 2``, against
                                             the same episodes packed by ``treepack pack --dp 2`` and trained from
                                             ``PackedDataset(dir, rank=r, dp=2)`` under DDP; control: every rank
                                             trains rank 0's micro-batches (a feed that ignores the rank)
    python feed_trl_more.py plan SPEC.json   one process, TRL on the step plans ``treepack serve --prefix-reuse C``
                                             hands out, against ``treepack pack --prefix-reuse C`` trained from the
                                             directory through the step-plan executor; control: one advantage changed

SPEC: ``{"feed": URL, "reference": [step dirs], "tokenizer": DIR, "work": DIR}``; prints the comparison as JSON, or
``{"skip": reason}`` where a part is missing.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from feed_trl import (  # noqa: E402
    RecordingFeed,
    changed_advantage,
    diff,
    param_diff,
    prepare,
    result,
    same_batches,
    skipped,
    tokens,
    trainer,
)
from support import torch  # noqa: E402

DP = 2


def ddp_worker(rank: int, spec: dict, port: int) -> None:
    """One rank: the directory reference, the control, the feed; writes its report (and final parameters) to WORK."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(DP), LOCAL_WORLD_SIZE=str(DP), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from treepack.torch import PackedDataset

    work, cfg = spec["work"], {"ddp_backend": "gloo"}
    mine = [b for d in spec["reference"] for b in PackedDataset(d, rank=rank, dp=DP)]
    out = {}
    began = time.time()
    t, cap = trainer(spec, itertools.chain(*(PackedDataset(d, rank=rank, dp=DP) for d in spec["reference"])), f"reference{rank}", **cfg)
    t.train()
    ref = result(t, cap)
    out["wrapper"] = type(t.model_wrapped).__name__
    out["reference_s"] = time.time() - began
    began = time.time()
    t, cap = trainer(spec, [b for d in spec["reference"] for b in PackedDataset(d, rank=0, dp=DP)], f"control{rank}", **cfg)
    t.train()
    out["control"] = diff(ref, result(t, cap))
    out["control_s"] = time.time() - began
    began = time.time()
    feed = RecordingFeed(spec["feed"], os.path.join(work, f"feed{rank}-events.json"), rank=rank, dp=DP)
    t, cap = trainer(spec, feed, f"feed{rank}", **cfg)
    t.train()
    got = result(t, cap)
    out["feed_s"] = time.time() - began
    out["feed"] = {**diff(ref, got), "events": feed.events, "same_batches": same_batches(feed.batches, mine)}
    out["logs"] = got["logs"]
    torch.save({"report": out, "params": got["params"]}, os.path.join(work, f"rank{rank}.pt"))


def ddp(spec: dict) -> None:
    if skipped():
        return
    import torch.multiprocessing as mp

    ranks = prepare(spec, dp=DP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.time()
    mp.spawn(ddp_worker, args=(spec, port), nprocs=DP, join=True)
    saved = [torch.load(os.path.join(spec["work"], f"rank{r}.pt")) for r in range(DP)]
    out = {
        "tokens": [tokens(flat) for flat in ranks],
        "ranks": [s["report"] for s in saved],
        "processes_s": time.time() - began,
        "ranks_params": max(param_diff(saved[0]["params"], s["params"]) for s in saved),
    }  # DDP keeps the ranks' parameters equal
    print(json.dumps(out))


def plan(spec: dict) -> None:
    if skipped():
        return
    from treepack.torch import PackedDataset

    [flat] = prepare(spec)
    manifests = [PackedDataset(d).manifest for d in spec["reference"]]
    out = {
        "tokens": tokens(flat),
        "prefix_tokens": [int(b.meta.get("prefix_tokens", 0)) for b in flat],
        "planned": {k: sum(int(m[k]) for m in manifests) for k in ("pushed_tokens", "computed_tokens")},
    }

    def executed(t) -> dict:
        runner = t.__dict__["_treepack_plan"]
        return {"pushed": runner.pushed, "computed": runner.computed, "left_cached": len(runner.stack)}

    began = time.time()
    t, cap = trainer(spec, itertools.chain(*(PackedDataset(d) for d in spec["reference"])), "reference")
    t.train()
    ref = result(t, cap)
    out["reference"] = executed(t)
    out["reference_s"] = time.time() - began
    began = time.time()
    t, cap = trainer(spec, changed_advantage(flat), "control")
    t.train()
    out["control"] = diff(ref, result(t, cap))
    out["control_s"] = time.time() - began
    began = time.time()
    feed = RecordingFeed(spec["feed"], os.path.join(spec["work"], "feed-events.json"))
    t, cap = trainer(spec, feed, "feed")
    t.train()
    out["feed_s"] = time.time() - began
    out["feed"] = {**diff(ref, result(t, cap)), **executed(t), "events": feed.events, "same_batches": same_batches(feed.batches, flat)}
    out["logs"] = ref["logs"]
    print(json.dumps(out))


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        given = json.load(f)
    {"ddp": ddp, "plan": plan}[sys.argv[1]](given)
