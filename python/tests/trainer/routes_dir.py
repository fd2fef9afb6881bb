"""Runs directories written by ``treepack pack`` from pre-tokenized JSONL with ``routes`` through a tiny Qwen3-MoE
(float64, test_moe.build) with the routes the loader put in ``batch.routes``, against every sequence unpacked through
the stock-attention twin replaying the routes its JSONL line gave (an unrouted last token: the router's own top-k).
Prints one JSON list, per directory the largest differences of per-token logprobs, load-balancing loss and parameter
gradients of a loss using both. ``plan:DIR`` runs the directory's step plan (``--prefix-reuse``) with
``run_step_plan(..., router=True)`` instead (the load-balancing loss of every micro-batch from its router outputs,
the cached prefix's included). Each directory's input is the one its manifest names. Called by
test/routes-replay.test.ts.

    python routes_dir.py [plan:]DIR ...
"""

from __future__ import annotations

import base64
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support import torch, tpt  # noqa: E402
from test_moe import build, unpacked  # noqa: E402


def own_routes(line: dict) -> torch.Tensor:
    """A JSONL line's routes as int64 [MoE layers, len(tokens), k]; the token the engine did not route: -1."""
    r = line["routes"]
    if isinstance(r, dict):
        dtype = {"uint8": "u1", "int16": "<i2", "int32": "<i4"}[r["dtype"]]
        arr = np.frombuffer(base64.b64decode(r["data"]), dtype=dtype).reshape(r["shape"]).astype(np.int64)
    else:
        arr = np.asarray(r, dtype=np.int64)
    n = len(line["tokens"])
    full = np.full((n, arr.shape[1], arr.shape[2]), -1, dtype=np.int64)
    full[: arr.shape[0]] = arr
    return torch.from_numpy(full).transpose(0, 1).contiguous()


def loss_of(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    occ = lp[mask]
    return occ.sum() + 0.1 * (occ**2).sum()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, plain, batches, routes, plan):  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    got_lp, ref_lp, aux_diff, pushed, auxes = [], [], 0.0, 0, []
    if plan:

        def plan_loss(lp, b, router):  # type: ignore[no-untyped-def]
            aux = tpt.load_balancing_loss(router, b)
            auxes.append(aux.detach())
            return loss_of(tpt.gather_occurrences(lp, b), b.loss_mask) + 0.5 * aux

        res = tpt.run_step_plan(model, batches, plan_loss, router=True)
        lps, pushed = res.logprobs, res.pushed_tokens
    for k, batch in enumerate(batches):
        own = [routes[sid] for sid in batch.meta["sequence_ids"]]
        ref, _, ref_router = unpacked(plain, batch, own)
        if plan:
            lp = tpt.gather_occurrences(lps[k], batch)
            aux_diff = max(aux_diff, abs(float(auxes[k] - tpt.load_balancing_loss(ref_router))))
        else:
            scores = tpt.packed_logprobs(model, batch, nodes="all")
            lp = tpt.gather_occurrences(scores.logprobs, batch)
            aux, ref_aux = tpt.load_balancing_loss(scores.router, batch), tpt.load_balancing_loss(ref_router)
            aux_diff = max(aux_diff, abs(float(aux - ref_aux)))
            (loss_of(lp, batch.loss_mask) + 0.5 * aux).backward()
        (loss_of(ref, batch.loss_mask) + 0.5 * tpt.load_balancing_loss(ref_router)).backward()
        t = batch.token_index > 0
        got_lp.append(lp[t].detach())
        ref_lp.append(ref[t].detach())
    g, ref_g = grads(model), grads(plain)
    return {
        "occurrences": sum(b.num_occurrences for b in batches),
        "nodes": sum(b.num_nodes for b in batches),
        "pushed_tokens": pushed,
        "logprob_diff": float((torch.cat(got_lp) - torch.cat(ref_lp)).abs().max()),
        "aux_diff": aux_diff,
        "aux_compared": len(auxes) if plan else len(batches),
        "grad_diff": max(float((g[n] - ref_g[n]).abs().max()) for n in ref_g),
    }


def main(*dirs: str) -> None:
    model, plain = build("qwen3_moe")
    out = []
    for d in dirs:
        plan = d.startswith("plan:")
        path = d[len("plan:") :] if plan else d
        dataset = tpt.PackedDataset(path)
        with open(dataset.manifest["input"]) as f:
            routes = {x["id"]: own_routes(x) for x in (json.loads(line) for line in f if line.strip())}
        out.append(compare(model, plain, list(dataset), routes, plan))
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
