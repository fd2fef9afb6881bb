"""Runs a packed directory written with ``treepack pack --prefix-reuse --dp K`` on K spawned gloo ranks (float64, a
tiny Qwen3), the manifest's shared pieces computed in shares (``run_step_plan(..., shared_prefixes=...)``), and
prints JSON: the largest differences of the summed loss, per-token logprobs and the parameter gradients summed over
the ranks from every sequence in one unsplit forest (stepplan_dir.py's reference), and per rank the tokens computed
with grad and pushed without it, and the rows the LM head scored (``head_rows``; ``piece_head_rows`` of them in the
pieces' passes, each member scoring only its range's nodes). Called by test/shared-prefix-run.test.ts.

    python shared_dir.py DIR [MODE,MODE,...]

MODE: ``shares`` (default); ``no_return`` (negative control: the pieces' gradients are never returned, so the
gradients must differ); ``fault`` (rank 1 fails at the window's end: every other rank must raise a TreepackError
naming the exchange and the piece within the group's timeout, reported as ``errors``); ``hybrid`` (a tiny Qwen3.5:
each range of a piece starts from the Gated DeltaNet states and convolution inputs the rank before hands over; against
the Qwen3.5's unsplit forest); ``window`` (a tiny gpt-oss, a sliding layer of window 4 with sinks: its members fetch
only the keys before their range within the window) and ``window_whole`` (the same with every layer fetching all the
keys before its range, as before the window routes: the same results, more bytes).
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
from treepack.torch.shared_prefix import Share  # noqa: E402

TIMEOUT_S = 10
FAMILY = {"hybrid": "qwen3_5", "window": "gpt_oss", "window_whole": "gpt_oss"}


def model_for(path: str, family: str):
    if family == "gpt_oss":
        from test_window import build

        return build("gpt_oss", window=4)[0]
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


def run_mode(rank: int, path: str, mode: str, out: str) -> dict:
    """One pass of the plan on this rank (module docstring's MODE)."""
    import torch.distributed as dist

    result: dict = {}
    model = model_for(path, FAMILY.get(mode, "qwen3"))
    batches = mine(path, rank)
    pieces = tpt.read_manifest(path).get("shared_prefixes", [])
    runner = tpt.stepplan.StepPlanRunner
    release, scores, piece_pass, window_route = runner.release_shared, runner._scores, runner._piece_pass, Share.window_route
    rows = {"head_rows": 0, "piece_head_rows": 0}
    in_piece = []

    def counted(self, hidden, forest, nodes):
        rows["piece_head_rows" if in_piece else "head_rows"] += int(nodes.numel())
        return scores(self, hidden, forest, nodes)

    def piece(self, share):
        in_piece.append(True)
        try:
            return piece_pass(self, share)
        finally:
            in_piece.pop()

    runner._scores, runner._piece_pass = counted, piece
    if mode == "window_whole":
        Share.window_route = lambda self, window: (self.before, torch.arange(self.a - self.piece.start))
    if mode == "no_return":
        # Negative control: the pieces are dropped after the window instead of back-propagated.
        def drop(self):
            self.held.clear()
            self.shares.clear()

        runner.release_shared = drop
    if mode == "fault" and rank == 1:
        # Fails at the window's end, while the others wait in the pieces' first exchange of their gradient return.
        def fail(self):
            raise RuntimeError("rank 1 failed (injected)")

        runner.release_shared = fail
    t0 = time.monotonic()
    try:
        res = tpt.run_step_plan(model, batches, loss_fn, attention="block", shared_prefixes=pieces, sync=False)
    except (TreepackError, RuntimeError) as e:
        return {
            "error": {
                "code": getattr(e, "code", None),
                "field": getattr(e, "field", None),
                "message": str(e),
                "after_s": time.monotonic() - t0,
            }
        }
    finally:
        runner.release_shared, runner._scores, runner._piece_pass, Share.window_route = release, scores, piece_pass, window_route
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
    result.update(
        loss=float(sum(res.losses)),
        logprobs={s: v.tolist() for b, lp in zip(batches, res.logprobs) for s, v in per_sequence(lp, b).items()},
        computed_tokens=res.computed_tokens,
        pushed_tokens=res.pushed_tokens,
        exchanged_bytes=res.exchanged_bytes,
        head_rows=rows["head_rows"] + rows["piece_head_rows"],
        piece_head_rows=rows["piece_head_rows"],
    )
    if rank == 0:
        torch.save({n: g for (n, _), g in zip(model.named_parameters(), grads)}, os.path.join(out, f"grads-{mode}.pt"))
    return result


def worker(rank: int, world: int, path: str, modes: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    results = {}
    for mode in modes:
        results[mode] = run_mode(rank, path, mode, out)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    if "fault" not in modes:
        dist.destroy_process_group()


def main(path: str, modes: str = "shares") -> None:
    """Every mode of ``modes`` (comma-separated, ``fault`` last: it breaks the group) in one spawn of the ranks."""
    import numpy as np
    import torch.multiprocessing as mp

    world = int(tpt.read_manifest(path).get("dp", 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = modes.split(",")
    with tempfile.TemporaryDirectory() as out:
        t0 = time.monotonic()
        mp.start_processes(worker, args=(world, path, names, port, out), nprocs=world, join=True, start_method="spawn")
        report: dict = {"wall_s": time.monotonic() - t0}
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        every = [b for r in range(world) for b in mine(path, r)]
        refs = {f: reference(model_for(path, f), every) for f in {FAMILY.get(m, "qwen3") for m in names}}
        for mode in names:
            ref = refs[FAMILY.get(mode, "qwen3")]
            got = [r[mode] for r in ranks]
            rep: dict = {"errors": [g.get("error") for g in got]}
            if all("loss" in g for g in got):
                lp = {s: np.array(v) for g in got for s, v in g["logprobs"].items()}
                grads = torch.load(os.path.join(out, f"grads-{mode}.pt"))
                rep.update(differences(ref, sum(g["loss"] for g in got), lp, grads))
                keys = ("computed_tokens", "pushed_tokens", "exchanged_bytes", "head_rows", "piece_head_rows")
                rep["ranks"] = [{k: g[k] for k in keys} for g in got]
            report[mode] = rep
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
