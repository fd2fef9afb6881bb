"""Shared pieces computed in shares (python/treepack/torch/shared_prefix.py, docs/design.md §11) for every model
family the step plan runs: three gloo processes (spawned) run a hand-written plan whose two pieces are each computed
once by their group, each rank its range, and ``run_step_plan(..., shared_prefixes=...)`` gives, summed over the
ranks, the loss, per-token logprobs and every parameter gradient of the unsplit forest within 1e-10 (float64):

- Qwen3 (attention only) and gpt-oss (a sliding window of 5 and sinks, its routers choosing);
- Qwen3.5 (Gated DeltaNet), Nemotron-H (Mamba2, MLP layers) and Kimi Linear (KDA, MLA): each range of a piece
  starts from the state and convolution inputs the rank before handed over, and the pieces end held by every
  member with their final state and convolution tail (the next piece and the micro-batches start from them);
- Qwen3-MoE with every node's routes replayed, and with ``router=True``: each micro-batch's load-balancing loss
  (added to its loss) equals its value run in full, gradient included;
- Qwen3-VL (``VL_PLAN``): one piece whose ranges cut a screenshot's fill twice, each member encoding the image for
  its placeholders (the vision tower's gradients included).

The plan (``PLAN``): piece 0, depths [0, 40) of a 70-token stem over ranks 0, 1, 2 (ranges of 13, 2 and 25 tokens:
the middle one shorter than the convolution's window, so rank 2's windows reach rank 0's inputs), piece 1,
[40, 70) above it over ranks 1 and 2 (across the 64-token chunk grid); micro-batches hang from both. Negative
controls: without the recurrent state hand-over (a zero start state for each range but the first), or without the
convolution inputs', the logprobs differ; so do they with the pieces' routes dropped. Gradient checkpointing on a
recurrent model is refused."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import unittest
import zlib

from support import needs_torch, spawned_ranks, tiny_model, torch, tpt
from test_vision import PIL_SKIP
from treepack import TreepackError

WORLD = 3
TOL = 1e-10
VOCAB = 61  # test_hybrid's and test_moe's tiny configs
PIECES = [
    {"id": 0, "start": 0, "end": 40, "ranks": [0, 1, 2], "ranges": [[0, 13], [13, 15], [15, 40]]},
    {"id": 1, "start": 40, "end": 70, "ranks": [1, 2], "ranges": [[40, 66], [66, 70]]},
]
RECURRENT = ("qwen3_5", "nemotron_h", "kimi_linear")
FAMILIES = ("qwen3", "gpt_oss") + RECURRENT + ("qwen3_moe",)


def sequences() -> dict[str, list[int]]:
    r = random.Random(3)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(70)
    return {
        "a0": stem[:40] + tok(5),
        "a1": stem[:40] + tok(3),
        "b0": stem + tok(4),
        "b1": stem + tok(6),
        "c0": stem[:40] + tok(7),
        "d0": stem + tok(2),
        "d1": stem + tok(5),
        "e0": tok(9),
    }


# Per rank, its micro-batches in order: (sequence ids, StepOp fields: prefix_tokens, push, release, shared pieces).
PLAN = {
    0: [(["e0"], (0, [], 0, ())), (["a0", "a1"], (40, [40], 1, (0,)))],
    1: [(["b0", "b1"], (70, [40, 70], 1, (0, 1))), (["c0"], (40, [], 1, ()))],
    2: [(["d0", "d1"], (70, [40, 70], 2, (0, 1)))],
}


def model_of(family: str):
    if family == "qwen3":
        return tiny_model("qwen3", torch.float64, vocab=VOCAB)
    if family == "gpt_oss":
        from test_window import build

        return build("gpt_oss")[0]
    if family == "qwen3_moe":
        from test_moe import build

        return build("qwen3_moe")[0]
    from test_hybrid import hybrid_model

    return hybrid_model(family, vocab=VOCAB)


def routes_of(model, seed: int = 0):
    """Random routes for every node of the whole forest ([MoE layers, N, k], a function of the node's token path so
    that every micro-batch replays a shared node alike)."""
    from test_moe import moe_shape

    L, E, k = moe_shape(model)

    def route(path: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(bytes(path)) + seed)
        return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(L)])

    return route


def batch_of(ids: list[str], op=None, route=None):
    """The micro-batch of the sequences ``ids`` (float64 occurrence data seeded by id), its step op in the header;
    with ``route``, every node's routes."""
    import numpy as np
    from treepack.pack import pack_sequences

    seqs = sequences()
    mb = pack_sequences([seqs[i] for i in ids])
    data = []
    for i in ids:
        g = np.random.default_rng(sum(map(ord, i)))
        n = len(seqs[i])
        mask = (g.random(n) < 0.8).astype(np.uint8)
        mask[0] = 0
        data.append((mask, g.standard_normal(n).astype(np.float32), (-g.random(n) * 3).astype(np.float32)))
    mb.loss_mask, mb.advantages, mb.old_logprobs = (np.concatenate(x) for x in zip(*data))
    mb.meta["sequence_ids"] = list(ids)
    if op is not None:
        h, push, release, shared = op
        mb.meta.update(prefix_tokens=h, prefix_push=push, prefix_release=release, prefix_shared=list(shared))
    batch = tpt.from_microbatch(mb)
    if route is not None:
        # A node's token path: its parent chain's tokens (the packed forest's nodes are trie nodes).
        parent, tokens, paths = batch.parent.tolist(), batch.input_ids.tolist(), []
        for j, p in enumerate(parent):
            paths.append((paths[p] if p >= 0 else ()) + (tokens[j],))
        batch.routes = torch.stack([route(p) for p in paths], dim=1) if paths else None
    return batch


def loss_fn(lp, batch, router=None):
    """test_stepplan's float64 loss, plus the load-balancing loss when given the router outputs."""
    occ = tpt.gather_occurrences(lp, batch)[batch.loss_mask]
    adv, old = batch.advantages[batch.loss_mask].double(), batch.old_logprobs[batch.loss_mask].double()
    loss = (adv * torch.exp(occ - old)).sum() + 0.1 * (occ**2).sum()
    return loss if router is None else loss + 0.5 * tpt.load_balancing_loss(router)


def per_sequence(lp, batch) -> dict[str, torch.Tensor]:
    occ = tpt.gather_occurrences(lp, batch)
    out = {}
    for i, sid in enumerate(batch.meta["sequence_ids"]):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        out[sid] = torch.where(batch.loss_mask[a:b], occ[a:b], torch.zeros_like(occ[a:b]))
    return out


def reference(family: str, routed: bool, router: bool) -> dict:
    """Every micro-batch of the plan run in full, in one process: losses summed, logprobs, gradients."""
    model = model_of(family)
    route = routes_of(model) if routed else None
    total, lps = 0.0, {}
    for rank in sorted(PLAN):
        for ids, _ in PLAN[rank]:
            batch = batch_of(ids, route=route)
            s = tpt.packed_logprobs(model, batch, attention="block", router=router)
            loss = loss_fn(s.logprobs, batch, s.router) if router else loss_fn(s.logprobs, batch)
            loss.backward()
            total += float(loss.detach())
            lps.update(per_sequence(s.logprobs.detach(), batch))
    return {"loss": total, "lp": lps, "grads": {n: p.grad for n, p in model.named_parameters()}}


def shares(rank: int, family: str, routed: bool = False, router: bool = False) -> dict:
    """This rank's micro-batches through ``run_step_plan`` with the pieces computed in shares (``summed``)."""
    model = model_of(family)
    route = routes_of(model) if routed else None
    batches = [batch_of(ids, op, route) for ids, op in PLAN[rank]]
    fn = loss_fn if router else (lambda lp, b: loss_fn(lp, b))
    res = tpt.run_step_plan(model, batches, fn, attention="block", block_size=4, router=router, shared_prefixes=PIECES, sync=False)
    return summed(model, batches, res, rank)


def summed(model, batches, res, rank: int) -> dict:
    """A rank's run: its losses summed, its sequences' logprobs, the gradients summed over the ranks (kept on rank 0),
    the tokens it computed with grad and without, the bytes its exchanges received."""
    import torch.distributed as dist

    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    lps = {}
    for b, lp in zip(batches, res.logprobs):
        lps.update(per_sequence(lp, b))
    return {
        "loss": float(sum(res.losses)),
        "lp": lps,
        "grads": grads if rank == 0 else None,
        "computed": res.computed_tokens,
        "pushed": res.pushed_tokens,
        "exchanged": res.exchanged_bytes,
    }


# A vision-language model (Qwen3-VL, deepstack): test_vision's agent episode, whose calls 0-3 share 17 tokens
# [1, 2, 3, START, 8 placeholders of screenshot a, END, 4, 5, 6, 7, 8], one piece over the three ranks whose ranges
# cut the image's fill twice (each member encodes the image for its placeholders).
VL_PIECES = [{"id": 0, "start": 0, "end": 17, "ranks": [0, 1, 2], "ranges": [[0, 6], [6, 9], [9, 17]]}]
VL_PLAN = {0: [((0,), (17, [17], 1, (0,)))], 1: [((1, 2), (17, [17], 1, (0,)))], 2: [((3,), (17, [17], 1, (0,))), ((4,), (0, [], 0, ()))]}


def vl_batch(members, op=None):
    import treepack
    from test_vision import PROC, episode, screenshots

    calls, masks = episode()
    mb = treepack.pack_images([calls[i] for i in members], screenshots(), PROC, loss_mask=[masks[i] for i in members])
    mb.meta["sequence_ids"] = [str(i) for i in members]
    if op is not None:
        h, push, release, shared = op
        mb.meta.update(prefix_tokens=h, prefix_push=push, prefix_release=release, prefix_shared=list(shared))
    return tpt.from_microbatch(mb)


def vl_loss(lp, batch):
    occ = tpt.gather_occurrences(lp, batch)[batch.loss_mask]
    w = torch.linspace(-1.0, 1.0, occ.shape[0], dtype=torch.float64)
    return (w * occ).sum() + 0.1 * (occ**2).sum()


def vl_model():
    from test_vision import tiny_vl

    model = tiny_vl("qwen3_vl")
    model.set_attn_implementation("treepack")
    return model


def vl_reference() -> dict:
    model, total, lps = vl_model(), 0.0, {}
    for rank in sorted(VL_PLAN):
        for members, _ in VL_PLAN[rank]:
            batch = vl_batch(members)
            lp = tpt.packed_logprobs(model, batch, attention="block").logprobs
            loss = vl_loss(lp, batch)
            loss.backward()
            total += float(loss.detach())
            lps.update(per_sequence(lp.detach(), batch))
    return {"loss": total, "lp": lps, "grads": {n: p.grad for n, p in model.named_parameters()}}


def vl_shares(rank: int) -> dict:
    model = vl_model()
    batches = [vl_batch(members, op) for members, op in VL_PLAN[rank]]
    res = tpt.run_step_plan(model, batches, vl_loss, attention="block", block_size=4, shared_prefixes=VL_PIECES, sync=False)
    return summed(model, batches, res, rank)


def refused(call) -> dict:
    try:
        call()
        return {}
    except TreepackError as e:
        return {"field": e.field, "message": str(e)}


def worker(rank: int, out: str) -> None:
    import torch.distributed as dist
    from treepack.torch import shared_prefix

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        got: dict = {"runs": {}, "controls": {}}
        for family in FAMILIES:
            got["runs"][family] = shares(rank, family, routed=family == "qwen3_moe")
        got["runs"]["qwen3_moe router"] = shares(rank, "qwen3_moe", routed=True, router=True)
        if not PIL_SKIP:
            got["runs"]["qwen3_vl"] = vl_shares(rank)
        # Negative controls: each range but the first starts from a zero state, or reads zero convolution inputs
        # before it (the messages still flow); the pieces' routes dropped.
        receive = shared_prefix.GroupPrefix._receive
        for kind in ("state", "conv"):
            shared_prefix.GroupPrefix._receive = lambda self, key, kind=kind: receive(self, key) * (0 if key[1] == kind else 1)
            try:
                got["controls"][kind] = shares(rank, "qwen3_5")
            finally:
                shared_prefix.GroupPrefix._receive = receive
        take = shared_prefix.Share.__init__

        def unrouted(self, piece, group, r, source, below, reads=None):
            take(self, piece, group, r, dataclasses.replace(source, routes=None), below, reads)

        shared_prefix.Share.__init__ = unrouted
        try:
            got["controls"]["routes"] = shares(rank, "qwen3_moe", routed=True)
        finally:
            shared_prefix.Share.__init__ = take
        model = model_of("qwen3_5").train()
        model.gradient_checkpointing_enable()
        got["checkpointing"] = refused(
            lambda: tpt.run_step_plan(model, [batch_of(ids, op) for ids, op in PLAN[rank]], loss_fn, shared_prefixes=PIECES)
        )
        got["failure"] = failing(rank)  # last: it breaks the group
        torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def failing(rank: int) -> dict:
    """Rank 1 fails after the piece's rows-read exchange, as its forward starts; the others, waiting on its recurrent
    states or keys, must raise a TreepackError naming the piece within the group's 5 s timeout."""
    import torch.distributed as dist
    from treepack.torch import shared_prefix

    for p in PIECES:  # the pieces' groups again, with a short timeout (every rank creates them)
        shared_prefix._GROUPS[tuple(p["ranks"])] = dist.new_group(p["ranks"], timeout=datetime.timedelta(seconds=5))
    model = model_of("qwen3_5")
    run = lambda: tpt.run_step_plan(model, [batch_of(ids, op) for ids, op in PLAN[rank]], loss_fn, shared_prefixes=PIECES)  # noqa: E731
    if rank != 1:
        return refused(run)

    def fail(*_: object) -> None:
        raise RuntimeError("rank 1 failed on purpose")

    shared_prefix.GroupPrefix.__init__ = fail  # type: ignore[method-assign]
    try:
        run()
    except RuntimeError as e:
        return {"message": str(e)}
    return {}


@needs_torch(transformers=True)
class SharedPiecesOfEveryFamily(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ranks = spawned_ranks(worker, WORLD)
        cls.reference = {f: reference(f, f == "qwen3_moe", False) for f in FAMILIES}
        cls.reference["qwen3_moe router"] = reference("qwen3_moe", True, True)
        if not PIL_SKIP:
            cls.reference["qwen3_vl"] = vl_reference()

    def compare(self, name: str, got: list[dict]) -> dict:
        ref = self.reference[name.split(" (")[0]]
        lp = {s: v for g in got for s, v in g["lp"].items()}
        self.assertEqual(sorted(lp), sorted(ref["lp"]))
        grads = got[0]["grads"]
        return {
            "loss": abs(sum(g["loss"] for g in got) - ref["loss"]),
            "lp": max(float((lp[s] - v).abs().max()) for s, v in ref["lp"].items()),
            "grad": max(float((grads[n] - g).abs().max()) for n, g in ref["grads"].items() if g is not None),
            "scale": max(float(g.abs().max()) for g in ref["grads"].values() if g is not None),
        }

    def test_every_family_equals_the_unsplit_run(self):
        # The load-balancing loss is no zero term: with it the loss is another.
        self.assertGreater(abs(self.reference["qwen3_moe router"]["loss"] - self.reference["qwen3_moe"]["loss"]), 1e-3)
        for name in list(FAMILIES) + ["qwen3_moe router"]:
            with self.subTest(family=name):
                d = self.compare(name, [r["runs"][name] for r in self.ranks])
                print(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in d.items()))
                self.assertGreater(d["scale"], 1e-3)
                for k in ("loss", "lp", "grad"):
                    self.assertLess(d[k], TOL * max(1.0, abs(self.reference[name]["loss"])) if k == "loss" else TOL, (name, k))

    @unittest.skipIf(bool(PIL_SKIP), PIL_SKIP)
    def test_images_across_ranges_equal_the_unsplit_run(self):
        d = self.compare("qwen3_vl", [r["runs"]["qwen3_vl"] for r in self.ranks])
        print("qwen3_vl: " + ", ".join(f"{k} {v:.1e}" for k, v in d.items()))
        self.assertGreater(float(self.reference["qwen3_vl"]["grads"]["model.visual.blocks.0.attn.qkv.weight"].abs().max()), 0)
        for k in ("loss", "lp", "grad"):
            self.assertLess(d[k], TOL, k)
        self.assertEqual([r["runs"]["qwen3_vl"]["pushed"] for r in self.ranks], [6, 3, 8])

    def test_each_rank_computes_its_ranges_and_exchanges(self):
        # Rank r's ranges of the pieces, pushed without grad and recomputed with it, plus its own micro-batches' nodes.
        ranges = [13, 2 + 26, 25 + 4]
        for r, rank in enumerate(self.ranks):
            got = rank["runs"]["qwen3_5"]
            self.assertEqual(got["pushed"], ranges[r])
            self.assertGreater(got["exchanged"], 0)

    def test_without_the_hand_overs_the_results_differ(self):
        for kind, family in (("state", "qwen3_5"), ("conv", "qwen3_5"), ("routes", "qwen3_moe")):
            d = self.compare(family, [r["controls"][kind] for r in self.ranks])
            print(f"without the {kind} hand-over: logprobs differ by {d['lp']:.1e}")
            self.assertGreater(d["lp"], 1e4 * TOL, kind)

    def test_a_failed_rank_is_named_by_the_others(self):
        self.assertEqual(self.ranks[1]["failure"]["message"], "rank 1 failed on purpose")
        for r in (0, 2):
            got = self.ranks[r]["failure"]
            print(f"rank {r}: {got.get('message')}")
            self.assertEqual(got.get("field"), "context_parallel", got)
            self.assertIn("shared piece 0 (data-parallel ranks [0, 1, 2]), layer 0 (Qwen3_5GatedDeltaNet)", got["message"])
            self.assertIn("failed", got["message"])

    def test_gradient_checkpointing_is_refused(self):
        for r in self.ranks:
            self.assertEqual(r["checkpointing"].get("field"), "gradient_checkpointing", r["checkpointing"])


if __name__ == "__main__":
    unittest.main()
