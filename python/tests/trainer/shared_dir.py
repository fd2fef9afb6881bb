"""Runs a packed directory written with ``treepack pack --prefix-reuse --dp K`` on K spawned gloo ranks (float64, a
tiny Qwen3), the manifest's shared pieces computed in shares (``run_step_plan(..., shared_prefixes=...)``), and
prints JSON: the largest differences of the summed loss, per-token logprobs and the parameter gradients summed over
the ranks from every sequence in one unsplit forest (stepplan_dir.py's reference), and per rank the tokens computed
with grad and pushed without it. Called by test/shared-prefix-run.test.ts.

    python shared_dir.py DIR [MODE]

MODE: ``shares`` (default); ``no_return`` (negative control: the pieces' gradients are never returned, so the
gradients must differ); ``fault`` (rank 1 dies before the window: every other rank must raise a TreepackError
naming the exchange and the piece within the group's timeout, reported as ``errors``); ``hybrid`` (a tiny Qwen3.5:
refused with a TreepackError naming the reason, reported as ``errors``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stepplan_dir import differences, loss_fn, per_sequence, reference  # noqa: E402
from support import tiny_model, torch, tpt  # noqa: E402
from treepack import TreepackError  # noqa: E402

TIMEOUT_S = 10


def model_for(path: str, family: str):
    manifest = tpt.read_manifest(path)
    batches = [tpt.load_microbatch(os.path.join(path, e["file"])) for e in manifest["micro_batches"]]
    vocab = max(8, 1 + max(int(b.input_ids.max()) for b in batches if b.num_nodes))
    if family == "qwen3_5":
        from test_hybrid import hybrid_model

        return hybrid_model("qwen3_5", vocab=vocab)
    return tiny_model("qwen3", torch.float64, vocab=vocab)


def mine(path: str, rank: int):
    """This rank's micro-batches in step order."""
    entries = tpt.read_manifest(path)["micro_batches"]
    picked = sorted((e["step"], i) for i, e in enumerate(entries) if e.get("rank", 0) == rank)
    return [tpt.load_microbatch(os.path.join(path, entries[i]["file"])) for _, i in picked]


def worker(rank: int, world: int, path: str, mode: str, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    result: dict = {"rank": rank}
    try:
        model = model_for(path, "qwen3_5" if mode == "hybrid" else "qwen3")
        batches = mine(path, rank)
        pieces = tpt.read_manifest(path).get("shared_prefixes", [])
        if mode == "no_return":
            # Negative control: the pieces are dropped after the window instead of back-propagated.
            def drop(self):
                self.held.clear()
                self.shares.clear()

            tpt.stepplan.StepPlanRunner.release_shared = drop
        if mode == "fault" and rank == 1:
            raise SystemExit(0)  # leaves before the window's first exchange
        t0 = time.monotonic()
        try:
            res = tpt.run_step_plan(model, batches, loss_fn, attention="block", shared_prefixes=pieces, sync=False)
        except TreepackError as e:
            result["errors"] = {"code": e.code, "field": e.field, "message": str(e), "after_s": time.monotonic() - t0}
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            for g in grads:
                dist.all_reduce(g)
            result.update(
                loss=float(sum(res.losses)),
                logprobs={s: v.tolist() for b, lp in zip(batches, res.logprobs) for s, v in per_sequence(lp, b).items()},
                computed_tokens=res.computed_tokens,
                pushed_tokens=res.pushed_tokens,
                exchanged_bytes=res.exchanged_bytes,
            )
            if rank == 0:
                torch.save({n: g for (n, _), g in zip(model.named_parameters(), grads)}, os.path.join(out, "grads.pt"))
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    if mode != "fault":
        dist.destroy_process_group()


def main(path: str, mode: str = "shares") -> None:
    import numpy as np
    import torch.multiprocessing as mp

    world = int(tpt.read_manifest(path).get("dp", 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        t0 = time.monotonic()
        try:
            mp.start_processes(worker, args=(world, path, mode, port, out), nprocs=world, join=True, start_method="spawn")
        except mp.ProcessRaisedException as e:
            print(json.dumps({"spawn_error": str(e)[-2000:]}))
            raise
        wall = time.monotonic() - t0
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        report: dict = {"mode": mode, "wall_s": wall, "errors": [r.get("errors") for r in ranks]}
        if all("loss" in r for r in ranks):
            model = model_for(path, "qwen3")
            batches = [b for r in range(world) for b in mine(path, r)]
            got_lp = {s: np.array(v) for r in ranks for s, v in r["logprobs"].items()}
            grads = torch.load(os.path.join(out, "grads.pt"))
            report.update(differences(reference(model, batches), sum(r["loss"] for r in ranks), got_lp, grads))
            report["ranks"] = [{k: r[k] for k in ("computed_tokens", "pushed_tokens", "exchanged_bytes")} for r in ranks]
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
