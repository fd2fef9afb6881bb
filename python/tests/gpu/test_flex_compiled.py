"""Compiled FlexAttention (treepack.torch.compiled_flex), the kernel a GPU runs, against the block-sparse path.

CPU (float32 forward: torch compiles no flex backward on CPU, and no float64):
- ``CompiledFlexCpu``: compiled flex equals the block path (run in float64, the oracle the trainer suites check
  against the dense rule) within float32 rounding on adversarial forests (one token, a ragged last block,
  duplicates, a prefix of another sequence, a chain deeper than 30, wide branching), plain and with a sliding
  window and sinks, and for step-plan rows (only the query rows past a cached prefix are computed); a negative
  control proves that the compiled kernel reads the block lists (zeroing the full-block counts changes its output,
  where eager flex ignores them); a gpt-oss model's logprobs (sliding and full layers with sinks) through compiled
  flex equal the unpacked run's; the refusals (a gradient or float64 on CPU, the recompile limit reached) are
  TreepackErrors.
- ``CompiledFlexCount`` (on CUDA when there is one, else CPU): 13 random micro-batch lengths (and step-plan rows
  of them) compile once per ladder rung they touch (3), counted in dynamo's cache of the compiled function, each
  result equal to the block path: neither a forest's content nor a query offset compiles again. Without the ladder
  each length would compile (and past 8, dynamo would fall back to uncompiled flex).

CUDA only (skipped here with the reason "needs CUDA"): forward and backward (q, k, v and the sinks' gradients)
equal the block path at B = 128 with windows and sinks, for all rows and for step-plan rows (four compilations).

Compiles are slow on a busy CPU (10-20 s each): the CPU cases share ten compiled variants.
Run: ``python -m unittest discover -s python/tests/gpu -p 'test_flex_compiled.py'`` from an installed treepack.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer"))

from support import forests, needs_torch, pack, torch, tpt  # noqa: E402
from treepack import TreepackError  # noqa: E402

CUDA = torch is not None and torch.cuda.is_available()
VOCAB = 13
# The two layer kinds of the CPU cases (one compiled variant each per rung): plain, and a window with sinks and a scale.
WINDOW_SINKS = {"window": 3, "sinks": True, "scale": 0.3}
B = 8  # the block size of the CPU cases: partial, full and skipped tiles all occur in ~40-node forests
H, HKV, D = 4, 2, 16


def setUpModule() -> None:
    # Dynamo guards every compiled variant on the number of registered pytree node types, and a model module
    # registers its output classes when it is first imported: gpt-oss's, imported up front, invalidates no variant.
    if torch is not None and importlib.util.find_spec("transformers") is not None:
        import transformers.models.gpt_oss.modeling_gpt_oss  # noqa: F401


# Node counts the adversarial forests are padded to: rung 6 of B = 8 (one compiled variant per layer kind), never a
# multiple of B (a ragged last block).
TARGETS = {"deep": 35, "wide": 41, "duplicates": 33, "prefix": 37, "mixed": 47, "depth>=30": 45}


def adversarial(seed: int = 0):
    """The shapes every equality test runs on and a chain deeper than 30 with branches, padded as the budgeted
    packer pads (roots of one node) to ``TARGETS``; and a single token."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    chain = tok(33)
    shapes = dict(forests(VOCAB, seed=seed))
    shapes["depth>=30"] = [chain, chain[:20] + tok(4), chain[:31] + tok(2)]
    out = {}
    for i, (name, seqs) in enumerate(shapes.items()):
        pad = TARGETS[name] - tpt.load_microbatch(pack(seqs)).num_nodes
        assert pad >= 0, name
        out[name] = tpt.load_microbatch(pack(seqs, pad=pad, seed=i))
    out["one token"] = tpt.load_microbatch(pack([[5]]))
    return out


def qkvs(n: int, seed: int, device: str = "cpu", dim: int = D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, n, dim, generator=g)
    k, v = (torch.randn(1, HKV, n, dim, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g)
    return tuple(x.to(device) for x in (q, k, v, sinks))


def block64(batch, q, k, v, **kw):
    """The oracle: the block path in float64."""
    with torch.no_grad():
        return tpt.attend(
            tpt.tree_mask(batch, mode="block", block_size=B),
            q.double(),
            k.double(),
            v.double(),
            sinks=None if kw.get("sinks") is None else kw["sinks"].double(),
            **{a: b for a, b in kw.items() if a != "sinks"},
        )


@needs_torch()
class CompiledFlexCpu(unittest.TestCase):
    def check(self, batch, seed, **kw):
        q, k, v, sinks = qkvs(batch.num_nodes, seed)
        kw = dict(kw, sinks=sinks if kw.get("sinks") else None)
        with torch.no_grad():
            got = tpt.attend(tpt.tree_mask(batch, mode="flex", block_size=B), q, k, v, **kw)
        want = block64(batch, q, k, v, **kw)
        self.assertEqual(got.shape, want.shape)
        self.assertEqual(got.dtype, torch.float32)
        self.assertLess(float((got.double() - want).abs().max()), 2e-6)
        return got

    def test_equals_block_path_on_adversarial_forests(self):
        for i, (name, batch) in enumerate(adversarial().items()):
            for kw in ({}, WINDOW_SINKS):
                with self.subTest(forest=name, **kw):
                    self.check(batch, i, **kw)

    def test_executed_tiles_count_one_tile_per_padded_query_block(self):
        # No compilation: the tiles of the padded BlockMask flex runs are the mask's own plus the diagonal tile of
        # each query block the ladder adds (padded rows see only themselves; nobody sees a padded key).
        padded = 0
        for name, batch in adversarial().items():
            n = batch.num_nodes
            added = (tpt.ladder_length(n, B) - B * -(-n // B)) // B
            padded += added
            for window in (None, 3):
                mask = tpt.windowed(tpt.tree_mask(batch, mode="flex", block_size=B), window)
                with self.subTest(forest=name, window=window):
                    listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
                    self.assertEqual(tpt.executed_tiles(mask), listed + added)
        self.assertGreater(padded, 0)  # 33, 35 and 37 nodes: 5 blocks, run at 6
        # An empty forest: no tiles, an empty output, nothing compiled.
        empty = tpt.tree_mask(torch.zeros(0, dtype=torch.int64), mode="flex", block_size=B)
        self.assertEqual(tpt.executed_tiles(empty), 0)
        x = torch.randn(1, H, 0, D)
        self.assertEqual(tuple(tpt.attend(empty, x, x[:, :HKV], x[:, :HKV]).shape), (1, H, 0, D))
        self.assertEqual([tpt.ladder_length(n, B) // B for n in (1, 8, 9, 17, 33, 41, 47, 49, 97)], [1, 1, 2, 3, 6, 6, 6, 8, 16])

    def test_the_padded_mask_reads_no_device_value(self):
        # Built on the meta device, whose tensors hold no values: any read-back (a device synchronisation on a GPU)
        # would raise. Shapes: the rungs of keys and queries, the sink block.
        from treepack.torch import compiled_flex

        n = 45
        se, pos = (torch.empty(n, dtype=torch.int64, device="meta") for _ in range(2))
        mask = tpt.windowed(tpt.tree_mask(se, mode="flex", block_size=B, position_ids=pos), 3)
        for rows, sinks, want in ((0, False, (48, 48)), (9, True, (48, 56)), (20, False, (32, 48))):
            block_mask, Lq, Lk = compiled_flex._padded_mask(mask, rows, sinks)
            self.assertEqual((Lq, Lk), want)
            self.assertEqual(tuple(block_mask.kv_indices.shape), (1, 1, Lq // B, Lk // B))

    def test_step_plan_rows(self):
        # Rows past a cached prefix (query rows [rows, N)), ranges that start inside a block. 45 nodes, rows 1 and 9:
        # the queries' rung is the keys' (6 blocks; at 9 it has a query block more than [9, 48) fills, whose rows see
        # nothing). 33 nodes, rows 1 and 5: rung 4, fewer query blocks than [rows, 48) holds.
        shapes = adversarial(1)
        for name, rows in (("depth>=30", 1), ("depth>=30", 9), ("duplicates", 1), ("duplicates", 5)):
            batch = shapes[name]
            with self.subTest(forest=name, rows=rows):
                got = self.check(batch, rows, rows=rows, **WINDOW_SINKS)
                self.assertEqual(got.shape[2], batch.num_nodes - rows)

    def test_the_window_and_the_sinks_change_the_result(self):
        # Negative controls for the cases above: without its window or its sinks the oracle differs from the one
        # compiled flex equals, so flex applies both.
        batch = adversarial()["depth>=30"]
        q, k, v, sinks = qkvs(batch.num_nodes, 0)
        want = block64(batch, q, k, v, window=3, sinks=sinks, scale=0.3)
        for kw in ({"window": 3}, {"sinks": sinks}):
            self.assertGreater(float((block64(batch, q, k, v, scale=0.3, **kw) - want).abs().max()), 1e-2, kw.keys())

    def test_the_compiled_kernel_reads_the_block_lists(self):
        from torch.nn.attention.flex_attention import BlockMask
        from treepack.torch import compiled_flex

        batch = adversarial()["depth>=30"]
        q, k, v, _ = qkvs(batch.num_nodes, 3)
        mask = tpt.tree_mask(batch, mode="flex", block_size=B)
        with torch.no_grad():
            got = tpt.attend(mask, q, k, v)
        bm, Lq, Lk = compiled_flex._padded_mask(mask, 0, False)
        self.assertGreater(int(bm.full_kv_num_blocks.sum()), 0)
        before = compiled_flex.flex_compilations()
        pad = lambda x, L: torch.nn.functional.pad(x, (0, 0, 0, L - batch.num_nodes))  # noqa: E731

        def run(kv_num, kv_idx, full_num, full_idx):
            m = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=bm.mask_mod, seq_lengths=(Lq, Lk))
            with torch.no_grad():
                return compiled_flex._compiled_flex()(pad(q, Lq), pad(k, Lk), pad(v, Lk), m, None, None, True)[:, :, : batch.num_nodes]

        # The same lists, rebuilt: the same output; the full blocks dropped (counts zeroed): another output.
        self.assertEqual(float((run(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices) - got).abs().max()), 0.0)
        dropped = run(bm.kv_num_blocks, bm.kv_indices, torch.zeros_like(bm.full_kv_num_blocks), bm.full_kv_indices)
        self.assertGreater(float((dropped - got).abs().max()), 1e-1)
        # The full blocks listed as partial ones instead (the mask_mod then decides their pairs): the same output.
        nb = bm.kv_indices.shape[-1]
        width = torch.arange(nb)

        def listed(num, idx):
            hit = torch.zeros(idx.shape[:-1] + (nb + 1,), dtype=torch.bool)
            return hit.scatter_(-1, torch.where(width < num[..., None], idx.long(), nb), True)[..., :nb]

        both = listed(bm.kv_num_blocks, bm.kv_indices) | listed(bm.full_kv_num_blocks, bm.full_kv_indices)
        merged_idx = torch.argsort((~both).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        merged = run(both.sum(-1).to(torch.int32), merged_idx, torch.zeros_like(bm.full_kv_num_blocks), bm.full_kv_indices)
        self.assertLess(float((merged - got).abs().max()), 1e-6)
        self.assertEqual(compiled_flex.flex_compilations(), before)  # same shapes: no new compilation

    @needs_torch(transformers=True)
    def test_model_logprobs_equal_the_unpacked_run(self):
        # gpt-oss in float32 (a sliding-window layer and a full one, both with sinks; GQA, MoE with the stock experts),
        # its attention through compiled flex at B = 8: per-token logprobs of the packed forest equal each sequence
        # run alone with stock attention.
        from test_window import gpt_oss_float32

        model, plain, batch, t = gpt_oss_float32()
        with torch.no_grad():
            mask = tpt.tree_mask(batch, mode="flex", block_size=B)
            ids, pos = batch.input_ids[None], batch.position_ids[None]
            hidden = model.model(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state
            lp = tpt.gather_occurrences(tpt.packed_logprobs(hidden, batch, lm_head=model.lm_head, nodes="all").logprobs, batch)
            for i in range(batch.num_sequences):
                a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
                if b - a < 2:
                    continue
                toks = batch.input_ids[batch.seq_positions[a:b]]
                want = torch.log_softmax(plain(toks[None], use_cache=False).logits[0, :-1].float(), -1).gather(1, toks[1:, None])[:, 0]
                self.assertLess(float((lp[a + 1 : b] - want).abs().max()), 1e-5, f"sequence {i}")
        self.assertGreater(int(t.sum()), 30)

    def test_refusals(self):
        from treepack.torch import compiled_flex

        batch = adversarial()["duplicates"]
        q, k, v, _ = qkvs(batch.num_nodes, 0)
        mask = tpt.tree_mask(batch, mode="flex", block_size=B)
        cases = [
            ("mode", "no backward on CPU", lambda: tpt.attend(mask, q.requires_grad_(True), k, v)),
            ("mode", "float64", lambda: tpt.attend(mask, q.detach().double(), k.double(), v.double())),
        ]
        # A shape past the recompile limit fails loudly (before compiling) instead of running uncompiled flex.
        limit = compiled_flex.COMPILE_LIMIT
        compiled_flex.COMPILE_LIMIT = compiled_flex.flex_compilations()
        try:
            odd = tpt.tree_mask(torch.tensor([1]), mode="flex", block_size=2)
            x = torch.randn(1, 3, 1, 4)
            cases.append(("mode", "recompile limit is reached", lambda: tpt.attend(odd, x, x, x)))
            for field, words, fn in cases:
                with self.subTest(words=words):
                    with self.assertRaises(TreepackError) as cm:
                        fn()
                    self.assertEqual(cm.exception.field, field)
                    self.assertIn(words, str(cm.exception))
        finally:
            compiled_flex.COMPILE_LIMIT = limit


@needs_torch()
class CompiledFlexCount(unittest.TestCase):
    def test_compilations_are_bounded_by_the_ladder(self):
        from treepack.torch import compiled_flex

        device = "cuda" if CUDA else "cpu"
        block = 128 if CUDA else 16
        # Random forests of 13 distinct lengths in (block, 4 · block]: the rungs 2, 3 and 4 blocks. A head dim of its
        # own (32), so that no other test's compilations are counted here.
        r, batches = random.Random(7), {}
        while len(batches) < 13:
            seqs = [[r.randrange(50) for _ in range(r.randrange(1, block))] for _ in range(r.randrange(2, 9))]
            mb = pack(seqs, pad=r.randrange(0, 3), seed=len(batches))
            n = len(mb.subtree_end)
            rung = compiled_flex.ladder_length(n, block)
            if block < n <= 4 * block and n not in batches and sum(compiled_flex.ladder_length(m, block) == rung for m in batches) < 5:
                batches[n] = tpt.load_microbatch(mb, device=device)
        rungs = {compiled_flex.ladder_length(n, block) for n in batches}
        self.assertEqual(rungs, {2 * block, 3 * block, 4 * block})
        before = compiled_flex.flex_compilations()
        for i, (n, batch) in enumerate(sorted(batches.items())):
            with self.subTest(n=n):
                q, k, v, _ = qkvs(n, i, device, dim=32)
                mask = tpt.tree_mask(batch, mode="flex", block_size=block)
                with torch.no_grad():
                    got = tpt.attend(mask, q, k, v)
                    want = tpt.attend(tpt.tree_mask(batch, mode="block", block_size=block), q.double(), k.double(), v.double())
                self.assertLess(float((got.double() - want).abs().max()), 2e-6 if device == "cpu" else 1e-4)
        # Step-plan rows whose queries stay on the keys' rung: the offset is a tensor the mask_mod reads, so a new
        # offset (like a new forest of the same rung) compiles nothing.
        offsets = 0
        for i, (n, batch) in enumerate(sorted(batches.items())):
            rows = 1 + i % 3
            if compiled_flex.ladder_length(n - rows, block) == compiled_flex.ladder_length(n, block):
                offsets += 1
                with self.subTest(n=n, rows=rows):
                    q, k, v, _ = qkvs(n, i, device, dim=32)
                    with torch.no_grad():
                        got = tpt.attend(tpt.tree_mask(batch, mode="flex", block_size=block), q, k, v, rows=rows)
                        want = tpt.attend(tpt.tree_mask(batch, mode="block", block_size=block), *(x.double() for x in (q, k, v)), rows=rows)
                    self.assertLess(float((got.double() - want).abs().max()), 2e-6 if device == "cpu" else 1e-4)
        self.assertGreaterEqual(offsets, 8)
        compiled = compiled_flex.flex_compilations() - before
        print(f"\ncompiled flex on {device}: {len(batches)} lengths, {len(rungs)} rungs, {compiled} compilation(s)", file=sys.stderr)
        self.assertEqual(compiled, len(rungs))


# Node counts the CUDA cases' forests are padded to: rung 4 of B = 128, ragged last blocks.
CUDA_TARGETS = {"depth>=30": 395, "mixed": 450, "duplicates": 470}


def cuda_forests(seed: int = 0):
    """Forests over several 128-token blocks (so that partial, full and skipped tiles occur at the GPU's block size),
    padded to ``CUDA_TARGETS``: a chain of 300 with branches (depth >= 30), a random mix of shared prefixes, and
    duplicates."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    chain = tok(300)
    mixed = []
    for _ in range(30):
        base = r.choice(mixed) if mixed and r.random() < 0.7 else []
        mixed.append(base[: r.randrange(0, len(base) + 1)] + tok(r.randrange(1, 30)))
    shapes = {
        "depth>=30": [chain, chain[:150] + tok(60), chain[:290] + tok(30)],
        "mixed": mixed,
        "duplicates": [chain[:200]] * 3 + [chain[:100] + tok(50)] * 2,
    }
    out = {}
    for i, (name, seqs) in enumerate(shapes.items()):
        pad = CUDA_TARGETS[name] - tpt.load_microbatch(pack(seqs)).num_nodes
        assert pad >= 0, name
        out[name] = tpt.load_microbatch(pack(seqs, pad=pad, seed=i), device="cuda")
    return out


@needs_torch(cuda="needs CUDA")
class CompiledFlexCuda(unittest.TestCase):
    def test_forward_and_backward_equal_the_block_path_with_windows_and_sinks(self):
        # float32 on the device, B = 128, plain and with a window (40 positions: it binds on these forests) and sinks,
        # which are a parameter: their gradient too. Rows > 0 are a step plan's: rows 7 keep the keys' rung (512),
        # rows N - 100 run at 128. Four compiled variants (forward and backward) in all.
        for name, batch in cuda_forests().items():
            n = batch.num_nodes
            for kw in ({}, {"window": 40, "sinks": True}):
                for rows in (0, 7, n - 100):
                    with self.subTest(forest=name, rows=rows, **kw):
                        results = []
                        for mode in ("flex", "block"):
                            q, k, v, sinks = (x.requires_grad_(True) for x in qkvs(n, 4, "cuda"))
                            out = tpt.attend(
                                tpt.tree_mask(batch, mode=mode),
                                q,
                                k,
                                v,
                                window=kw.get("window"),
                                sinks=sinks if kw.get("sinks") else None,
                                rows=rows,
                            )
                            out.backward(torch.cos(torch.arange(out.numel(), device="cuda", dtype=out.dtype)).reshape(out.shape))
                            results.append((out.detach(), q.grad, k.grad, v.grad, sinks.grad))
                        self.assertEqual(results[0][0].shape[2], n - rows)
                        for what, a, c in zip(("out", "dq", "dk", "dv", "dsinks"), *results):
                            if c is None:
                                self.assertIsNone(a, what)
                            else:  # float32 sums over up to 470 rows (the sinks' over every row and head)
                                self.assertLess(float((a - c).abs().max()), 1e-4 * max(1.0, float(c.abs().max())), what)
                        if kw.get("sinks"):
                            self.assertGreater(float(results[0][4].abs().max()), 0.0)


if __name__ == "__main__":
    unittest.main()
