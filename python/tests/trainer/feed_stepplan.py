"""A trainer on ``treepack serve --prefix-reuse``: pulls each rank's planned micro-batches with ``FeedClient`` and runs
them through the step-plan executor against the same sequences unsplit (``stepplan_dir.compare``, float64, tiny
Qwen3 and, given FAMILY, a tiny hybrid). On rank 0 first a trainer that dies after pulling its first micro-batch (the
one that pushes the shared trunk): a second trainer gets nothing of that rank's plan while the lease holds, then the
whole plan from its first micro-batch, in order. Prints JSON; called by test/serve-stepplan.test.ts.

    python feed_stepplan.py URL DP LEASE_SECONDS [FAMILY ...]
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stepplan_dir import compare, loss_fn  # noqa: E402
from support import tiny_model, torch, tpt  # noqa: E402
from treepack.client import FeedClient  # noqa: E402
from treepack.errors import TreepackError  # noqa: E402

# Qwen3's vocabulary: logits in chunks this small keep a float64 forward under 100 MB.
CHUNK = 64


def pull_all(client: FeedClient) -> list:
    out = []
    for mb in iter(client.next, None):
        out.append(mb)
    return out


def main(url: str, dp: str, lease: str, *families: str) -> None:
    dp_n, lease_s = int(dp), float(lease)
    dead = FeedClient(url, rank=0, dp=dp_n, wait=0)
    first = dead.next()
    replacement = FeedClient(url, rank=0, dp=dp_n, wait=0)
    during_lease = replacement.next()  # the first trainer still holds rank 0's plan
    time.sleep(lease_s + 0.5)  # ... and died: its lease runs out
    ranks = [pull_all(replacement)] + [pull_all(FeedClient(url, rank=r, dp=dp_n, wait=0)) for r in range(1, dp_n)]
    report = {
        "first": {"id": first.id, "prefix_push": first.entry["prefix_push"], "prefix_tokens": first.entry["prefix_tokens"]},
        "during_lease": None if during_lease is None else during_lease.id,
        "ranks": [
            [
                {
                    "id": mb.id,
                    "rank": mb.entry["rank"],
                    "step": mb.entry["step"],
                    "feed_step": mb.entry["feed_step"],
                    "prefix_tokens": mb.entry["prefix_tokens"],
                    "prefix_push": mb.entry["prefix_push"],
                    "prefix_release": mb.entry["prefix_release"],
                    "nodes": mb.batch.num_nodes,
                }
                for mb in mine
            ]
            for mine in ranks
        ],
    }
    batches = [[mb.batch for mb in mine] for mine in ranks]
    vocab = next(b.vocab_size for mine in batches for b in mine if b.vocab_size is not None)
    report["results"] = {}
    for family in families or ("qwen3",):
        if family == "qwen3":
            model = tiny_model("qwen3", torch.float64, vocab=vocab)
        else:
            from test_hybrid import hybrid_model

            model = hybrid_model(family, vocab=vocab)
        report["results"][family] = compare(model, batches, chunk_size=CHUNK)
    # What a replacement trainer got from the feed before runs: rank 0's plan without the micro-batch that pushes the trunk.
    try:
        tpt.run_step_plan(model, batches[0][1:], loss_fn, attention="block", chunk_size=CHUNK)
        report["control"] = "ran"
    except TreepackError as e:
        report["control"] = f"{e.code}: {e}"
    report["acks"] = [mb.ack()["step_done"] for mine in ranks for mb in mine]
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
