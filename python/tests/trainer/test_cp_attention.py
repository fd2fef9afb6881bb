"""Context parallelism for one packed row (treepack.torch.context_parallel) over gloo on CPU, float64.

Three spawned ranks split each row at chosen bounds and run ``packed_logprobs`` + ``packed_loss`` + backward on their
local parts, then sum the parameter gradients over the group; every rank also runs the row alone. Per-token logprobs
of each rank's nodes, the loss and every parameter gradient equal the one-rank run's within 1e-10, for tiny Qwen3
(block and dense attention) and gpt-oss (sliding window 4 + sinks, MoE), on forests whose bounds fall inside a radix
segment, at a branch point (the branch node ending a rank, and starting one), one segment spanning the three ranks, a
rank whose nodes carry no trainable token, ragged blocks (block size 4, parts of 3-36 nodes) and pad nodes;
token-mean, seq-mean-token-mean, GSPO with sequence TIS and turn-level aggregation (turns cut by a bound). Negative
control: with the key/value exchange replaced by zeros the logprobs differ. Scoring every node (``nodes="all"``), each
rank's local nodes equal the one-rank run's and its context nodes are left NaN (their owners score them). Recurrent
layers: test_cp_recurrent.py.
Two ranks: a group of the wrong size and ranks holding different rows are refused on every rank with a TreepackError
naming the fault; a rank that fails before the exchange makes the other raise TreepackError (E_BACKEND) within the
group's 5 s timeout, no hang.

The ranks are spawned, not forked: a fork after torch's OpenMP pool has run leaves the children waiting on it."""

from __future__ import annotations

import datetime
import functools
import json
import os
import tempfile
import time
import unittest

from support import needs_torch, pack, torch, tpt
from treepack import TreepackError

VOCAB = 61
TOL = 1e-10


def forest():
    """A prompt of 10 tokens (nodes 0-9) branching into [a] and [b (5) -> c | d], and a second tree; 3 pad nodes."""
    P = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31]
    a, b, c, d = [2, 4, 6, 8, 10, 12, 14], [40, 41, 42, 43, 44], [50, 51, 52, 53], [55, 56, 57, 58, 59, 1]
    return pack([P + a, P + b + c, P + b + d, P[:4], [9, 8, 7, 6, 5, 4, 3, 2]], pad=3, seed=4)


def cases(batch):
    """(name, bounds) for the three ranks; node numbers from the packed forest's own structure."""
    parent = batch.parent.tolist()
    children: dict[int, list[int]] = {}
    for p, q in enumerate(parent):
        children.setdefault(q, []).append(p)
    branch = [p for p, kids in sorted(children.items()) if p >= 0 and len(kids) >= 2]  # the prompt's end, then b's end
    N = batch.num_nodes
    return {
        "inside_segments": (0, 5, branch[1] - 2, N),  # both bounds inside chains
        "after_branch_points": (0, branch[0] + 1, branch[1] + 1, N),  # each branch node ends a rank
        "at_branch_points": (0, branch[0], branch[1], N),  # each branch node starts a rank
        "segment_over_three": (0, 3, 7, N),  # the prompt [0, 10) spans all three ranks
        "no_scored_rank0": (0, 10, 25, N),  # rank 0 owns the prompt, made untrainable below
    }


def build(family):
    if family == "qwen3":
        from support import tiny_model

        return tiny_model("qwen3", torch.float64, vocab=VOCAB)
    from test_moe import build as moe_build

    return moe_build("gpt_oss")[0]


def run_case(model, batch, bounds, attention, config, group):
    """(reference lp [N], reference loss, reference grads, the split run's local lp [A + n], loss metric, grads)."""
    model.zero_grad(set_to_none=True)
    lp = tpt.packed_logprobs(model, batch, attention=attention).logprobs
    loss, metrics = tpt.packed_loss(lp, batch, config)
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    cp = tpt.ContextParallel.of(batch, group=group, bounds=bounds)
    local = tpt.split_batch(batch, cp)
    llp = tpt.packed_logprobs(model, local, attention=attention).logprobs
    lloss, lmetrics = tpt.packed_loss(llp, local, config)
    lloss.backward()
    tpt.reduce_gradients(model, cp)
    got = [p.grad.clone() for p in model.parameters()]
    A = local.context_parallel.rows
    a, b = torch.nan_to_num(lp.detach()[cp.lo : cp.hi], nan=7.0), torch.nan_to_num(llp.detach()[A:], nan=7.0)
    return {
        "lp": float((a - b).abs().max()),
        "loss": abs(lmetrics["loss"] - metrics["loss"]),
        "metrics": max(abs(lmetrics[k] - metrics[k]) for k in metrics),
        "grad": max(float((x - y).abs().max()) for x, y in zip(ref, got)),
        "grad_scale": max(float(x.abs().max()) for x in ref),
        "scored": int(local.loss_mask.sum()),
        "context": A,
        "local": cp.hi - cp.lo,
    }


CONFIGS = {
    "token-mean": {"clip_low": 0.2, "clip_high": 0.28, "kl": "k3", "kl_coef": 0.1},
    "seq-mean-token-mean": {"clip_low": 0.2, "aggregation": "seq-mean-token-mean"},
    "gspo": {"policy": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "tis": "sequence", "tis_cap": 2.0, "aggregation": "seq-mean-token-sum"},
    "turn-mean": {"clip_low": 0.2, "aggregation": "seq-mean-turn-mean-token-mean"},
}


def main_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    import treepack.torch.attention as attention
    import treepack.torch.logprobs as logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    # Blocks of 4: every part's last block is ragged, and a context spans several blocks.
    logprobs.tree_mask = functools.partial(attention.tree_mask, block_size=4)
    results = {}
    batch = tpt.load_microbatch(forest())
    plan = cases(batch)
    batch.loss_mask[batch.seq_positions < 10] = False  # the prompt is not trained: rank 0 of no_scored_rank0 scores nothing
    # Turns of 3 tokens: a turn cut by a rank's bound counts once, with its tokens on both ranks.
    batch.turn_ids = torch.div(batch.token_index + 1, 3, rounding_mode="floor")
    runs = [
        ("qwen3", "block", name, bounds, cfg)
        for (name, bounds), cfg in zip(plan.items(), ["token-mean", "seq-mean-token-mean", "gspo", "token-mean", "seq-mean-token-mean"])
    ]
    runs += [("qwen3", "dense", "inside_segments", plan["inside_segments"], "gspo")]
    runs += [("qwen3", "block", name, plan[name], "turn-mean") for name in ("inside_segments", "after_branch_points")]
    runs += [
        ("gpt_oss", mode, name, plan[name], "token-mean") for mode, name in (("block", "inside_segments"), ("dense", "segment_over_three"))
    ]
    runs += [("gpt_oss", "block", "at_branch_points", plan["at_branch_points"], "seq-mean-token-mean")]
    models = {f: build(f) for f in ("qwen3", "gpt_oss")}
    for family, mode, name, bounds, cfg in runs:
        results[f"{family}/{mode}/{name}/{cfg}"] = run_case(models[family], batch, bounds, mode, CONFIGS[cfg], None)

    # The turn-mean cases stress what they say: trainable turns whose tokens lie on two ranks.
    from treepack.torch.loss_terms import turn_runs

    run, _ = turn_runs(batch.seq_offsets, batch.seq_index, batch.turn_ids)
    trained = batch.loss_mask.bool()
    for name in ("inside_segments", "after_branch_points"):
        owner = torch.searchsorted(torch.tensor(plan[name]), batch.seq_positions, right=True) - 1
        ranks = [set(owner[trained & (run == r)].tolist()) for r in range(int(run.max()) + 1)]
        results[f"split_turns/{name}"] = sum(len(o) > 1 for o in ranks)

    # Every node scored (nodes="all"): the local ones equal the one-rank run's, the context's are left to their owners.
    with torch.no_grad():
        ref = tpt.packed_logprobs(models["qwen3"], batch, nodes="all", attention="block").logprobs
        cp = tpt.ContextParallel.of(batch, bounds=plan["segment_over_three"])
        local = tpt.split_batch(batch, cp)
        got = tpt.packed_logprobs(models["qwen3"], local, nodes="all", attention="block").logprobs
    A = local.context_parallel.rows
    results["all_nodes"] = {
        "lp": float((torch.nan_to_num(ref[cp.lo : cp.hi], nan=7.0) - torch.nan_to_num(got[A:], nan=7.0)).abs().max()),
        "context_nan": bool(got[:A].isnan().all()),
        "scored": int((~got[A:].isnan()).sum()),
    }

    # Negative control: the context's keys/values (and hidden rows) replaced by zeros, no exchange.
    from treepack.torch.context_parallel import LocalPart

    real = LocalPart.fetch
    LocalPart.fetch = lambda self, x, route, what: x.new_zeros((route.owner.numel(),) + tuple(x.shape[1:]))
    try:
        results["control"] = run_case(models["qwen3"], batch, plan["inside_segments"], "block", CONFIGS["token-mean"], None)
    finally:
        LocalPart.fetch = real

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def moe_worker(rank: int, world: int, out: str) -> None:
    """Routing replay and the load-balancing loss on local parts: tiny Qwen3-MoE, routes that conflict on shared
    prefixes (the tree split there), bounds balanced and inside segments."""
    import torch.distributed as dist
    from support import forests
    from test_moe import build as moe_build
    from test_moe import routed_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = moe_build("qwen3_moe")[0]
    batch, _ = routed_batch(model, forests(VOCAB, seed=5)["mixed"], seed=3, conflicts=True)
    config = CONFIGS["seq-mean-token-mean"]
    N = batch.num_nodes
    results = {}
    for name, bounds in (("balanced", None), ("inside_segments", (0, N // 3 + 1, 2 * N // 3 - 1, N))):
        model.zero_grad(set_to_none=True)
        scores = tpt.packed_logprobs(model, batch, attention="block")
        loss, metrics = tpt.packed_loss(scores.logprobs, batch, config, router=scores.router, aux_coef=0.5)
        loss.backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        cp = tpt.ContextParallel.of(batch, bounds=bounds)
        local = tpt.split_batch(batch, cp)
        A = local.context_parallel.rows
        lscores = tpt.packed_logprobs(model, local, attention="block")
        lloss, lmetrics = tpt.packed_loss(lscores.logprobs, local, config, router=lscores.router, aux_coef=0.5)
        _, values = tpt.PackedLoss(config, aux_coef=0.5)(lscores.logprobs.detach(), local, router=lscores.router)
        lloss.backward()
        tpt.reduce_gradients(model, cp)
        got = [p.grad.clone() for p in model.parameters()]
        # the per-rank losses (each with its aux share) sum to the one-rank loss
        total = lloss.detach().clone()
        dist.all_reduce(total)
        a, b = torch.nan_to_num(scores.logprobs.detach()[cp.lo : cp.hi], nan=7.0), torch.nan_to_num(lscores.logprobs.detach()[A:], nan=7.0)
        results[name] = {
            "lp": float((a - b).abs().max()),
            "experts": bool(torch.equal(lscores.router.experts, batch.routes[:, cp.lo : cp.hi])),
            "aux": abs(lmetrics["aux_loss"] - metrics["aux_loss"]),
            "aux_value": metrics["aux_loss"],
            "aux_packed_loss_class": abs(float(values[-1]) - metrics["aux_loss"]),
            "loss": abs(lmetrics["loss"] - metrics["loss"]),
            "loss_sum": abs(float(total) - float(loss.detach())),
            "grad": max(float((x - y).abs().max()) for x, y in zip(ref, got)),
            "grad_scale": max(float(x.abs().max()) for x in ref),
            "context": A,
        }
    # Negative control: the local part without its routes (the routers' own top-k) scores other logprobs.
    with torch.no_grad():
        ref = tpt.packed_logprobs(model, batch, attention="block").logprobs
        cp = tpt.ContextParallel.of(batch)
        local = tpt.split_batch(batch, cp)
        local.routes = None
        got = tpt.packed_logprobs(model, local, attention="block").logprobs[local.context_parallel.rows :]
    results["control"] = float((torch.nan_to_num(ref[cp.lo : cp.hi], nan=7.0) - torch.nan_to_num(got, nan=7.0)).abs().max())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def fault_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=5))
    model = build("qwen3")
    batch = tpt.load_microbatch(forest())
    results = {}

    def attempt(name, fn):
        start = time.monotonic()
        try:
            fn()
            results[name] = {"error": "", "code": ""}
        except TreepackError as e:
            results[name] = {"error": str(e), "code": e.code}
        results[name]["seconds"] = time.monotonic() - start

    attempt("wrong_size", lambda: tpt.ContextParallel.of(batch, bounds=(0, 10, 20, batch.num_nodes)))
    other = tpt.load_microbatch(pack([[1, 2, 3, 4, 5, 6]], seed=1)) if rank == 1 else batch
    attempt("different_rows", lambda: tpt.split_batch(other, tpt.ContextParallel.of(other, bounds=(0, 3, other.num_nodes))))
    cp = tpt.ContextParallel.of(batch, bounds=(0, 12, batch.num_nodes))
    local = tpt.split_batch(batch, cp)
    if rank == 1:  # this rank fails before the forward: rank 0 is left alone in its exchange
        results["failed_rank"] = {"error": "simulated failure", "code": "", "seconds": 0.0}
        time.sleep(8)
    else:
        attempt("failed_rank", lambda: tpt.packed_logprobs(model, local, attention="block"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def spawn(worker, world):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(world, out), nprocs=world, join=True, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results


@needs_torch(transformers=True)
class ContextParallelOverGloo(unittest.TestCase):
    def test_split_runs_equal_the_one_rank_run(self):
        ranks = spawn(main_worker, 3)
        for name in ranks[0]:
            if name in ("control", "all_nodes") or name.startswith("split_turns/"):
                continue
            for r, res in enumerate(ranks):
                got = res[name]
                with self.subTest(case=name, rank=r):
                    self.assertLessEqual(got["lp"], TOL)
                    self.assertLessEqual(got["loss"], TOL)
                    self.assertLessEqual(got["metrics"], TOL)
                    self.assertLessEqual(got["grad"], TOL * max(1.0, got["grad_scale"]))
                    self.assertGreater(got["grad_scale"], 1e-3)
        # The forests stress what they say: rank 0 of no_scored_rank0 trains nothing; inside segments and over three
        # ranks, ranks 1 and 2 have contexts (ancestors held by lower ranks).
        self.assertEqual(ranks[0]["qwen3/block/no_scored_rank0/seq-mean-token-mean"]["scored"], 0)
        self.assertGreater(ranks[1]["qwen3/block/no_scored_rank0/seq-mean-token-mean"]["scored"], 0)
        for r in (1, 2):
            self.assertGreater(ranks[r]["qwen3/block/segment_over_three/token-mean"]["context"], 0)
            self.assertGreater(ranks[r]["qwen3/block/inside_segments/token-mean"]["context"], 0)
        self.assertTrue(any(res["qwen3/block/inside_segments/token-mean"]["local"] % 4 for res in ranks))
        self.assertGreater(ranks[0]["split_turns/inside_segments"], 0)
        self.assertGreater(ranks[0]["split_turns/after_branch_points"], 0)
        for res in ranks:
            self.assertLessEqual(res["all_nodes"]["lp"], TOL)
            self.assertTrue(res["all_nodes"]["context_nan"])
            self.assertGreater(res["all_nodes"]["scored"], 0)
        control = max(res["control"]["lp"] for res in ranks)
        self.assertGreater(control, 1e-3, "without the key/value exchange the logprobs must differ")
        self.assertEqual(ranks[0]["control"]["lp"], 0.0)  # rank 0 has no context: nothing to exchange

    def test_moe_routing_replay_and_aux_loss_equal_the_one_rank_run(self):
        ranks = spawn(moe_worker, 3)
        for name in ("balanced", "inside_segments"):
            for r, res in enumerate(ranks):
                got = res[name]
                with self.subTest(case=name, rank=r):
                    self.assertTrue(got["experts"])  # each rank's routers used its local nodes' routes
                    for k in ("lp", "aux", "aux_packed_loss_class", "loss", "loss_sum"):
                        self.assertLessEqual(got[k], TOL, k)
                    self.assertGreater(got["aux_value"], 0.1)
                    self.assertLessEqual(got["grad"], TOL * max(1.0, got["grad_scale"]))
                    self.assertGreater(got["grad_scale"], 1e-3)
            self.assertTrue(any(res[name]["context"] > 0 for res in ranks))
        self.assertGreater(max(res["control"] for res in ranks), 1e-6, "without replay the local parts' logprobs must differ")

    def test_faults_are_refused_on_every_rank_without_hanging(self):
        ranks = spawn(fault_worker, 2)
        for r, res in enumerate(ranks):
            with self.subTest(rank=r):
                self.assertIn("split the row over 3 ranks but the context-parallel group has 2", res["wrong_size"]["error"])
                self.assertIn("rank(s) [1] hold a different row", res["different_rows"]["error"])
        failed = ranks[0]["failed_rank"]
        self.assertEqual(failed["code"], "E_BACKEND", failed)
        self.assertIn("context-parallel rank 0 of 2", failed["error"])
        self.assertLess(failed["seconds"], 30.0)


if __name__ == "__main__":
    unittest.main()
