"""Step plans over context-parallel groups (treepack.torch.cp_plan): a forest packed by the real CLI with ``--max-tokens 12
--prefix-reuse 16 --dp 2 --cp 2`` (a stem of 24 tokens no rank can cache alone, so the planner picks
``cp``: each micro-batch names ``cp_ranks`` [0, 1]) run on two spawned gloo ranks, float64, each rank taking its
micro-batches from ``treepack.list_microbatches(dir, rank=r)`` (the group's, listed under rank 0).

Against every sequence in one unsplit forest: per-token logprobs (on every rank), the loss and every parameter
gradient within 1e-10, for a tiny Qwen3 under DistributedDataParallel (``sync_gradients``' average times the world
size) and gpt-oss (sliding window 4, sinks, MoE; the ranks' shares summed); and the same forest twice packed with
``--dp 4 --cp 2`` on four ranks, two groups of two (Qwen3 under DDP). What it stresses: the stem's push is split
inside the segment (each rank holds its half of the chain, the cache spread over both ranks), the 1-token segment
pushes a rank's range empty (its throw-away root), and rank 0's share of the second micro-batch has no trainable
token; each rank's cache peaks at about half of what one rank running the plan alone holds.
``StepPlanRunner(entropy=True)``: entropies and the gradient of a loss reading them equal one rank running the same
micro-batches. A tiny Qwen3-MoE replaying every node's routes, and with ``router=True`` (a load-balancing loss per
micro-batch), against each micro-batch run whole in one process, within 1e-10. ``exchanged_bytes`` counts the
logprobs' all-gather besides the fetches. Negative controls: with the cached parts' keys/values replaced by zeros in
the fetch, or with the routers choosing instead of replaying the routes, the logprobs differ. gpt-oss's sliding-window
layer fetches fewer bytes than its full layer. Hybrids, whose recurrent layers hand states and convolution inputs
from rank to rank and start from the cached chain's: tiny Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba2) within
1e-10 of the unsplit forest; started from zeros instead of the chain's state and inputs (control), the logprobs
differ. Refusals: a vision-language model (tiny Qwen3-VL) by name, in one process; ``cp_ranks``
naming ranks the world lacks, naming them; a rank that does not run its group's micro-batches (it takes only the
entries listed under its own rank; on four ranks, it makes the groups but does not come) is named on the other within
the group's 15 s timeout.

The ranks are spawned, not forked: a fork after torch's OpenMP pool has run leaves the children waiting on it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import subprocess
import tempfile
import time
import types
import unittest

from support import needs_torch, torch, tpt

CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "dist", "src", "cli", "main.js")
TIMEOUT_S = 15
TOL = 1e-10
ROUTED = ("routes", "router", "no_routes")  # the modes of a tiny Qwen3-MoE replaying every node's routes
HYBRIDS = ("qwen3_5", "nemotron_h", "kimi_linear")  # Gated DeltaNet, Mamba2, KDA (with attention layers)


def write_forest(directory: str, world: int) -> str:
    """Per group of two ranks, a stem of 24 tokens, two sub-stems (one of a single token), three episodes under each;
    packed at 12 computed and 16 cached tokens per rank over ``world`` ranks, with context-parallel groups of up to 2."""
    r = random.Random(5)

    def tok(n: int) -> list[int]:
        return [r.randrange(1, 60) for _ in range(n)]

    lines = []
    for t in range(world // 2):
        stem = tok(24)
        for g, sub in enumerate((8, 1)):
            head = stem + tok(sub)
            for e in range(3):
                seq = head + tok(4) + tok(5)
                lines.append(json.dumps({"id": f"t{t}g{g}e{e}", "tokens": seq, "advantages": [round(r.uniform(-1, 1), 2)] * len(seq)}))
    src, out = os.path.join(directory, f"in{world}.jsonl"), os.path.join(directory, f"out{world}")
    with open(src, "w") as f:
        f.write("\n".join(lines) + "\n")
    args = ["--max-tokens", "12", "--prefix-reuse", "16", "--dp", str(world), "--cp", "2", "--quiet"]
    subprocess.run(["node", CLI, "pack", src, "--out", out, *args], check=True)
    return out


def stress(batches):
    """Rank 0's share of the second micro-batch made untrainable (the same in the reference)."""
    b = batches[1]
    h = int(b.meta["prefix_tokens"])
    lo, hi = tpt.cp_plan.split_bounds(b.subtree_end, h, 2)[:2]
    b.loss_mask[(b.seq_positions >= lo) & (b.seq_positions < hi)] = False
    return batches


def model_for(family: str):
    if family in ("gpt_oss", "qwen3_moe"):
        from test_moe import build

        return build(family)[0]
    if family in HYBRIDS:
        from test_hybrid import hybrid_model

        return hybrid_model(family, vocab=61)
    from support import tiny_model

    return tiny_model("qwen3", torch.float64, vocab=61)


def routed(model, batches):
    """Every node's routes replayed (test_cp_shared_pieces' random routes, a function of the node's token path, so
    that a node cached by one micro-batch and computed by another routes alike): copies of ``batches``."""
    from test_cp_shared_pieces import routes_of

    route, out = routes_of(model), []
    for b in batches:
        parent, tokens, paths = b.parent.tolist(), b.input_ids.tolist(), []
        for j, p in enumerate(parent):
            paths.append((paths[p] if p >= 0 else ()) + (tokens[j],))
        out.append(dataclasses.replace(b, routes=torch.stack([route(p) for p in paths], dim=1)))
    return out


def router_loss(lp, batch, router):
    """stepplan_dir's loss plus the micro-batch's load-balancing loss (its occurrences weighing the nodes)."""
    from stepplan_dir import loss_fn

    return loss_fn(lp, batch) + 0.5 * tpt.load_balancing_loss(router, batch)


def whole_batches(model, batches, router: bool):
    """Each micro-batch run whole in one process (its cached prefix recomputed; routes replayed): the reference of
    the routed modes, whose load-balancing loss is per micro-batch. Loss summed, per-sequence logprobs, gradients."""
    from stepplan_dir import loss_fn, per_sequence

    total, lps = 0.0, {}
    for b in batches:
        s = tpt.packed_logprobs(model, b, attention="block", router=router)
        loss = router_loss(s.logprobs, b, s.router) if router else loss_fn(s.logprobs, b)
        loss.backward()
        total += float(loss.detach())
        lps.update(per_sequence(s.logprobs.detach(), b))
    return total, lps, {n: p.grad for n, p in model.named_parameters()}


def entropy_run(model, batches, ops) -> dict:
    """The micro-batches through ``StepPlanRunner(entropy=True)`` with a loss that reads the entropies too: the
    per-sequence entropies (the parameters' ``.grad`` left set)."""
    from stepplan_dir import loss_fn, per_sequence

    runner, got = tpt.StepPlanRunner(model, attention="block", entropy=True), {}
    for b, op in zip(batches, ops):
        s = runner.forward(b, op)
        (loss_fn(s.logprobs, b) + 0.01 * tpt.gather_occurrences(s.entropy, b)[b.loss_mask].sum()).backward()
        runner.release()
        got.update({k: v.tolist() for k, v in per_sequence(s.entropy.detach(), b).items()})
    runner.finish()
    return got


def run_mode(rank: int, world: int, path: str, mode: str, out: str) -> dict:
    import treepack.torch.cp_plan as cp_plan
    from stepplan_dir import loss_fn, per_sequence
    from treepack import TreepackError, list_microbatches, read_manifest

    files = list_microbatches(path, rank=rank)
    if mode == "missing" and rank == 1:
        # Takes only the entries listed under its own rank: none, every micro-batch being its group's (rank 0's).
        entries = read_manifest(path)["micro_batches"]
        files = [os.path.join(path, e["file"]) for e in entries if e["rank"] == 1]
    batches = stress([tpt.load_microbatch(f) for f in files]) if files else []
    families = {"gpt_oss": "gpt_oss", "no_hand_over": "qwen3_5", **{h: h for h in HYBRIDS}}
    family = families.get(mode, "qwen3_moe" if mode in ROUTED else "qwen3")
    model = model_for(family)
    if family == "qwen3_moe":
        batches = routed(model, batches)
    init, state, tail = cp_plan._Hook.__init__, cp_plan._Hook.state, cp_plan._Hook.tail
    if mode == "no_hand_over":
        # Negative control: the row's first nodes start from zeros, not from the cached chain's state and inputs.
        cp_plan._Hook.state = lambda self, key: torch.zeros_like(state(self, key))
        cp_plan._Hook.tail = lambda self, key, t: torch.zeros_like(tail(self, key, t))
    if mode == "no_fetch":
        # Negative control: the cached parts' keys/values every attention layer fetches are zeros.
        def zeros(self, plan, parts, *rest):
            parts = [types.SimpleNamespace(cache={k: torch.zeros_like(t) for k, t in p.cache.items()}) for p in parts]
            init(self, plan, parts, *rest)

        cp_plan._Hook.__init__ = zeros
    replay, fetch, fetched, by_layer = cp_plan.replay_routes, cp_plan.CPPlan.fetch, [0], {}

    def counted(self, x, route, what):  # the bytes the keys/values and hidden states' fetches bring in (per layer too)
        before = self.stats.get("received_bytes", 0)
        got = fetch(self, x, route, what)
        fetched[0] += self.stats.get("received_bytes", 0) - before
        layer = what.split("'s keys/values")[0] if "'s keys/values" in what else None
        if layer is not None:
            by_layer[layer] = by_layer.get(layer, 0) + self.stats.get("received_bytes", 0) - before
        return got

    cp_plan.CPPlan.fetch = counted
    if mode == "no_routes":
        # Negative control: the routers choose their own experts instead of replaying the nodes' routes.
        cp_plan.replay_routes = lambda model, routes, tokens: replay(model, None, tokens=tokens)
    net, ops = model, None
    if mode == "qwen3":
        net = torch.nn.parallel.DistributedDataParallel(model)
    t0 = time.monotonic()
    if mode == "entropy":
        ops = [tpt.step_op(b) for b in batches]
        cp_plan.make_groups(ops)
        got = entropy_run(model, batches, ops)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        for g in grads:
            torch.distributed.all_reduce(g)
        if rank == 0:
            torch.save({n: g for (n, _), g in zip(model.named_parameters(), grads)}, os.path.join(out, f"grads-{mode}.pt"))
        return {"entropy": got}
    if mode == "absent" and rank == 3:
        # Creates the groups, as run_step_plan does, but never runs its group's micro-batches: rank 2 waits for it.
        cp_plan.make_groups(tpt.step_op(b) for b in batches)
        time.sleep(TIMEOUT_S + 5)
        return {}
    if mode == "group_of_four":  # cp_ranks naming ranks this world of two does not have
        ops = [tpt.step_op(b)._replace(cp_ranks=(0, 1, 2, 3)) for b in batches]
    try:
        fn, router = (router_loss, True) if mode == "router" else (loss_fn, False)
        res = tpt.run_step_plan(net, batches, fn, attention="block", sync=mode == "qwen3", ops=ops, router=router)
    except TreepackError as e:
        return {"error": {"code": e.code, "field": e.field, "message": str(e), "after_s": time.monotonic() - t0}}
    finally:
        cp_plan._Hook.__init__, cp_plan.replay_routes, cp_plan.CPPlan.fetch = init, replay, fetch
        cp_plan._Hook.state, cp_plan._Hook.tail = state, tail
    if mode == "missing":
        time.sleep(TIMEOUT_S + 5)  # rank 1 stays up while rank 0 waits for it
        return {}
    if mode == "absent":
        return {}  # group [0, 1] ran its plan; rank 3's absence is the test
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    if mode == "qwen3":
        grads = [g * world for g in grads]  # sync_gradients averaged the shares: the sum is the step's gradient
    else:
        for g in grads:
            dist.all_reduce(g)
    if rank == 0:
        torch.save({n: g for (n, _), g in zip(model.named_parameters(), grads)}, os.path.join(out, f"grads-{mode}.pt"))
    return {
        "loss": float(sum(res.losses)),
        "logprobs": {s: v.tolist() for b, lp in zip(batches, res.logprobs) for s, v in per_sequence(lp, b).items()},
        "computed_tokens": res.computed_tokens,
        "pushed_tokens": res.pushed_tokens,
        "peak_cached_tokens": res.peak_cached_tokens,
        "peak_cached_bytes": res.peak_cached_bytes,
        "exchanged_bytes": res.exchanged_bytes,
        "fetched_bytes": fetched[0],
        "fetched_by_layer": by_layer,
        "layer_types": getattr(model.config, "layer_types", None),
        # the least the logprobs' all-gather brings a rank of two: the other rank's rows, at least half of each [N] (float64)
        "gathered_at_least": sum(8 * (b.num_nodes // 2) for b in batches),
    }


def worker(rank: int, world: int, path: str, modes: list[str], store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    results = {}
    for mode in modes:
        results[mode] = run_mode(rank, world, path, mode, out)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


# Per world size, the modes its spawned ranks run ("missing", "absent" last: they break the groups).
RUNS = {
    2: ["qwen3", "gpt_oss", *ROUTED, "no_fetch", "entropy", *HYBRIDS, "no_hand_over", "group_of_four", "missing"],
    4: ["qwen3", "absent"],
}


def spawn(tmp: str, world: int, modes: list[str]) -> dict:
    """Packs the forest for ``world`` ranks, runs ``modes`` on that many spawned ranks, and compares each run with the
    unsplit forest of every micro-batch (each group's, stressed alike)."""
    import numpy as np
    import torch.multiprocessing as mp
    from stepplan_dir import reference
    from treepack import list_microbatches, read_manifest

    path = write_forest(tmp, world)
    out = os.path.join(tmp, f"results{world}")
    os.makedirs(out)
    t0 = time.monotonic()
    mp.start_processes(
        worker, args=(world, path, modes, os.path.join(tmp, f"store{world}"), out), nprocs=world, join=True, start_method="spawn"
    )
    run: dict = {"path": path, "manifest": read_manifest(path), "wall_s": time.monotonic() - t0, "ranks": [], "diffs": {}}
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            run["ranks"].append(json.load(f))
    batches = [b for g in range(0, world, 2) for b in stress([tpt.load_microbatch(f) for f in list_microbatches(path, rank=g)])]
    for mode in modes:
        family = {"no_fetch": "qwen3", "no_hand_over": "qwen3_5"}.get(mode, mode)
        if mode in ("group_of_four", "missing", "absent"):
            continue
        if mode == "entropy":  # against the same micro-batches run by one rank (cp_ranks dropped)
            model = model_for("qwen3")
            ref = entropy_run(model, batches, [tpt.step_op(b)._replace(cp_ranks=()) for b in batches])
            grads = torch.load(os.path.join(out, f"grads-{mode}.pt"))
            got = {s: v for r in run["ranks"] for s, v in r[mode]["entropy"].items()}
            run["diffs"][mode] = {
                "entropy": max(float(np.abs(np.array(v) - np.array(ref[s])).max()) for s, v in got.items()),
                "sequences": sorted(got) == sorted(ref),
                "grads": max(float((grads[n] - p.grad).abs().max()) for n, p in model.named_parameters()),
            }
            continue
        if mode == "qwen3":  # the cache one rank would hold running its group's plan alone (cp_ranks dropped)
            from stepplan_dir import loss_fn

            group0 = batches[: len(list_microbatches(path, rank=0))]
            ops = [tpt.step_op(b)._replace(cp_ranks=()) for b in group0]
            run["one_rank_peak_bytes"] = tpt.run_step_plan(model_for(family), group0, loss_fn, ops=ops).peak_cached_bytes
        if mode in ROUTED:
            model = model_for("qwen3_moe")
            loss, ref_lp, ref_grads = whole_batches(model, routed(model, batches), mode == "router")
        else:
            loss, ref_lp, ref_grads = reference(model_for(family), batches)
        got = [r[mode] for r in run["ranks"]]
        grads = torch.load(os.path.join(out, f"grads-{mode}.pt"))
        run["diffs"][mode] = {
            "loss": abs(sum(g["loss"] for g in got[::2]) - loss) / max(1.0, abs(loss)),
            "logprobs": max(float(np.abs(np.array(v) - ref_lp[s]).max()) for g in got for s, v in g["logprobs"].items()),
            "sequences": sorted({s for g in got for s in g["logprobs"]}) == sorted(ref_lp),
            "grads": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
            "same_losses": all(got[r]["loss"] == got[r + 1]["loss"] for r in range(0, world, 2)),
            "reference_loss": loss,
        }
    return run


@needs_torch(transformers=True)
class CPPlanTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.runs = {world: spawn(cls.tmp.name, world, modes) for world, modes in RUNS.items()}
        for world, run in cls.runs.items():
            peaks = [r["qwen3"]["peak_cached_bytes"] for r in run["ranks"]]
            print(
                f"\ntest_cp_plan: {world} ranks in {run['wall_s']:.1f} s; differences {run['diffs']}; cached bytes at peak per rank "
                f"{peaks} (one rank alone: {run.get('one_rank_peak_bytes')})",
                flush=True,
            )

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_planner_chose_context_parallel_groups(self):
        from treepack import list_microbatches

        for world, run in self.runs.items():
            plans = run["manifest"]["parallel_plans"]
            self.assertTrue(all(p["mode"] == "cp" and p["cp"] == 2 for p in plans), plans)
            entries = run["manifest"]["micro_batches"]
            self.assertTrue(all(e["cp_ranks"] == [e["rank"], e["rank"] + 1] and e["rank"] % 2 == 0 for e in entries))
            self.assertEqual({e["rank"] for e in entries}, set(range(0, world, 2)))
            pushes = [end for e in entries if e["rank"] == 0 for end in e["prefix_push"]]
            self.assertIn(24, pushes)  # the stem, split over both ranks
            self.assertTrue(any(b - a == 1 for a, b in zip([0] + pushes, pushes)), pushes)  # a segment shorter than the group
            # A rank's micro-batches are its group's, listed under its first rank, in step order (PackedDataset alike).
            for r in range(world):
                mine = [e for e in entries if r in e["cp_ranks"]]
                want = [os.path.join(run["path"], *e["file"].split("/")) for e in mine]
                self.assertEqual(list_microbatches(run["path"], rank=r), want)
                self.assertEqual(tpt.PackedDataset(run["path"], rank=r, dp=world).files(), want)

    def test_equal_to_the_unsplit_forest(self):
        for world, mode in [(2, m) for m in ("qwen3", "gpt_oss", "routes", "router", *HYBRIDS)] + [(4, "qwen3")]:
            d = self.runs[world]["diffs"][mode]
            self.assertTrue(d["sequences"], (world, mode))
            self.assertLess(d["loss"], TOL, (world, mode))
            self.assertLess(d["logprobs"], TOL, (world, mode))
            self.assertLess(d["grads"], TOL, (world, mode))
            self.assertTrue(d["same_losses"], (world, mode))

    def test_each_rank_computes_its_share(self):
        got = [r["qwen3"] for r in self.runs[2]["ranks"]]
        entries = self.runs[2]["manifest"]["micro_batches"]
        # Every computed token once per group: the micro-batches' own nodes and the popped segments (pushed again).
        want = sum(e["computed_tokens"] for e in entries) + sum(e["pushed_tokens"] for e in entries)
        self.assertEqual(sum(g["computed_tokens"] for g in got), want)
        self.assertEqual(sum(g["pushed_tokens"] for g in got), sum(e["pushed_tokens"] for e in entries))
        for g in got:
            self.assertLess(g["computed_tokens"], 0.75 * want)
        # Each rank holds its part of the cached chain, not the whole: about half of what one rank alone would hold.
        one = self.runs[2]["one_rank_peak_bytes"]
        for g in got:
            self.assertEqual(g["peak_cached_tokens"], 32)
            self.assertLess(g["peak_cached_bytes"], 0.6 * one)
        self.assertGreaterEqual(sum(g["peak_cached_bytes"] for g in got), one)

    def test_entropies_and_their_gradient_equal_one_rank_running_the_plan(self):
        d = self.runs[2]["diffs"]["entropy"]
        self.assertTrue(d["sequences"])
        self.assertLess(d["entropy"], TOL)
        self.assertLess(d["grads"], TOL)

    def test_cp_ranks_beyond_the_world_are_named(self):
        for r in self.runs[2]["ranks"]:
            e = r["group_of_four"]["error"]
            self.assertEqual((e["code"], e["field"]), ("E_INPUT", "cp_ranks"))
            self.assertIn("rank(s) [2, 3] do not exist", e["message"])

    def test_without_the_cached_keys_the_results_differ(self):
        self.assertGreater(self.runs[2]["diffs"]["no_fetch"]["logprobs"], 1e-3)

    def test_routes_are_replayed_and_the_load_balancing_loss_counts(self):
        diffs = self.runs[2]["diffs"]
        # The routers left to choose differ from the replayed routes; the load-balancing loss is not zero.
        self.assertGreater(diffs["no_routes"]["logprobs"], 1e-3)
        self.assertGreater(abs(diffs["router"]["reference_loss"] - diffs["routes"]["reference_loss"]), 1e-3)

    def test_a_sliding_window_layer_fetches_only_its_window(self):
        # gpt-oss alternates sliding (window 4) and full layers of the same key/value size: over the plan, each rank's
        # sliding layer fetches fewer context keys than its full layer (the results above equal the unsplit forest).
        for g in (r["gpt_oss"] for r in self.runs[2]["ranks"]):
            kinds = dict(enumerate(g["layer_types"]))
            sliding = [b for k, b in g["fetched_by_layer"].items() if kinds[int(k.split()[1])] == "sliding_attention"]
            full = [b for k, b in g["fetched_by_layer"].items() if kinds[int(k.split()[1])] == "full_attention"]
            self.assertEqual((len(sliding), len(full)), (1, 1), g["fetched_by_layer"])
            self.assertLess(sliding[0], 0.8 * full[0], g["fetched_by_layer"])

    def test_exchanged_bytes_count_the_logprob_gather(self):
        # Besides the keys/values and hidden states its contexts fetch, each rank receives the other's rows of every
        # micro-batch's logprobs.
        for g in (r["qwen3"] for r in self.runs[2]["ranks"]):
            self.assertGreater(g["fetched_bytes"], 0)
            self.assertGreaterEqual(g["exchanged_bytes"] - g["fetched_bytes"], g["gathered_at_least"])

    def test_without_the_chains_recurrent_hand_over_the_results_differ(self):
        # Qwen3.5's Gated DeltaNet layers with the row's first nodes started from zeros instead of the cached chain's
        # final state and last convolution inputs (the hybrids above, handed over, equal the unsplit forest).
        self.assertGreater(self.runs[2]["diffs"]["no_hand_over"]["logprobs"], 1e-3)

    def test_a_rank_missing_from_the_group_is_named(self):
        e = self.runs[2]["ranks"][0]["missing"]["error"]
        self.assertEqual((e["code"], e["field"]), ("E_BACKEND", "cp_ranks"))
        self.assertRegex(e["message"], r"rank\(s\) 1 of ranks \[0, 1\] did not come")
        self.assertLess(e["after_s"], 3 * TIMEOUT_S)
        # In a group of a larger world: rank 3 made the groups but does not run group [2, 3]'s micro-batch; rank 2 names
        # it (monitored_barrier counts ranks in the group), group [0, 1] runs its plan.
        got = [r["absent"] for r in self.runs[4]["ranks"]]
        self.assertEqual([g.get("error") for g in got[:2]], [None, None])
        e = got[2]["error"]
        self.assertEqual((e["code"], e["field"]), ("E_BACKEND", "cp_ranks"))
        self.assertRegex(e["message"], r"rank 2: rank\(s\) 3 of ranks \[2, 3\] did not come to a micro-batch of context-parallel ranks")
        self.assertLess(e["after_s"], 3 * TIMEOUT_S)


@needs_torch(transformers=True)
class CPPlanImagesTest(unittest.TestCase):
    def test_a_vision_language_model_is_refused_by_name(self):
        from test_vision import tiny_vl
        from treepack import TreepackError
        from treepack.pack import pack_sequences

        model = tiny_vl("qwen3_vl")
        model.set_attn_implementation("treepack")
        batch = tpt.from_microbatch(pack_sequences([[1, 2, 3], [1, 2, 4]]))
        with self.assertRaises(TreepackError) as got:
            tpt.StepPlanRunner(model).forward(batch, tpt.step_op(batch)._replace(cp_ranks=(0, 1)))
        self.assertEqual((got.exception.code, got.exception.field), ("E_ARG", "cp_ranks"))
        self.assertRegex(str(got.exception), r"Qwen3VLForConditionalGeneration has a vision encoder.*pack without --cp")


if __name__ == "__main__":
    unittest.main()
