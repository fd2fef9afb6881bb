"""Tree attention paths against each other and against the dense rule: block-sparse == dense SDPA in forward and
backward (GQA, block sizes that do not divide N, pad nodes), the TreeMask's block arrays == the numpy reference, and
the attention's errors. Compiled flex (forward on CPU, backward on CUDA): python/tests/gpu/test_flex_compiled.py."""

import unittest

import numpy as np
from support import forests, needs_torch, pack, torch, tpt

# isort: split
# support (above) puts python/tests on sys.path, where mask_reference lives
from mask_reference import block_arrays_from_dense, dense_mask
from treepack import TreepackError


def qkv(n, heads=4, kv_heads=2, dim=8, seed=0, dtype=None):
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float64
    q = torch.randn(1, heads, n, dim, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, n, dim, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, n, dim, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


@needs_torch()
class TreeAttention(unittest.TestCase):
    def test_block_sparse_equals_dense_forward_and_backward(self):
        for seed, (shape, seqs) in enumerate(forests(13, seed=2).items()):
            mb = tpt.load_microbatch(pack(seqs, pad=seed % 3, seed=seed))
            for B in (1, 3, 16, 128):
                with self.subTest(forest=shape, block_size=B):
                    results = []
                    for mode in ("dense", "block"):
                        q, k, v = qkv(mb.num_nodes, seed=seed)
                        out = tpt.attend(tpt.tree_mask(mb, mode=mode, block_size=B), q, k, v, scale=0.3)
                        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape))
                        results.append((out.detach(), q.grad, k.grad, v.grad))
                    for a, b in zip(*results):
                        self.assertLess(float((a - b).abs().max()), 1e-12)

    def test_block_plan_calls_are_bounded_and_cover_every_listed_block(self):
        from treepack.torch.attention import PLAN_TILES, _block_plan

        mb = tpt.load_microbatch(pack(forests(13, seed=5)["deep"], pad=0))
        for B in (1, 3, 16):
            mask = tpt.tree_mask(mb, mode="block", block_size=B)
            listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
            plan = _block_plan(mask)
            with self.subTest(block_size=B):
                self.assertEqual(sorted(int(r) for rows, _, _ in plan for r in rows), list(range(-(-mb.num_nodes // B))))
                for rows, keys, _ in plan:
                    self.assertTrue(len(rows) == 1 or len(rows) * keys.shape[1] // B <= PLAN_TILES)
                tiles = tpt.executed_tiles(mask)
                self.assertEqual(tiles, sum(keys.numel() // B for _, keys, _ in plan))
                self.assertGreaterEqual(tiles, listed)
                self.assertLessEqual(tiles, 2 * listed)  # power-of-two groups pad a row by less than its own count

    def test_dense_mode_is_the_rule(self):
        mb = tpt.load_microbatch(pack(forests(13, seed=4)["mixed"], pad=1))
        q, k, v = qkv(mb.num_nodes)
        rule = torch.from_numpy(dense_mask(mb.subtree_end.numpy()))
        self.assertTrue(torch.equal(tpt.dense_tree_mask(mb.subtree_end), rule))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=rule)
        out = tpt.attend(tpt.tree_mask(mb, mode="dense"), q, k, v)
        self.assertLess(float((out - ref).abs().max()), 1e-12)

    def test_flex_mask_lists_equal_the_reference(self):
        # What compiled flex runs on them: python/tests/gpu/test_flex_compiled.py.
        mb = tpt.load_microbatch(pack(forests(13, seed=5)["mixed"], pad=2))
        for B in (4, 128):
            mask = tpt.tree_mask(mb, mode="flex", block_size=B)
            ref_arrays = block_arrays_from_dense(dense_mask(mb.subtree_end.numpy()), B)
            got = (mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0], mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0])
            for a, b in zip(got, ref_arrays[1:]):
                self.assertTrue(np.array_equal(a.numpy(), b))

    def test_auto_is_block_on_cpu(self):
        self.assertEqual(tpt.tree_mask(torch.tensor([2, 2])).mode, "block")

    def test_errors_name_the_field(self):
        mb = tpt.load_microbatch(pack(forests(13, seed=6)["mixed"]))
        q, k, v = qkv(mb.num_nodes)
        cases = [
            ("attention_mask", lambda: tpt.attend(tpt.dense_tree_mask(mb.subtree_end), q, k, v)),
            ("attention_mask", lambda: tpt.attend(tpt.tree_mask(torch.tensor([1])), q, k, v)),  # another batch's mask
            ("mode", lambda: tpt.tree_mask(mb, mode="sparse")),
            ("mode", lambda: tpt.attend(tpt.tree_mask(mb, mode="flex"), q, k, v)),  # flex has no CPU backward
            ("subtree_end", lambda: tpt.tree_mask(mb.subtree_end.float())),
            ("subtree_end", lambda: tpt.tree_mask(torch.tensor([1, 1]))),
            ("block_size", lambda: tpt.tree_mask(mb, block_size=0)),
            ("attention_mask", lambda: tpt.tree_attention(torch.nn.Module(), q, k, v, None)),
            ("sliding_window", lambda: tpt.tree_attention(torch.nn.Module(), q, k, v, tpt.tree_mask(mb), sliding_window=8)),
        ]
        for field, fn in cases:
            with self.subTest(field=field):
                with self.assertRaises(TreepackError) as cm:
                    fn()
                self.assertEqual(cm.exception.field, field, str(cm.exception))

    def test_registered_with_transformers(self):
        from transformers import AttentionInterface

        self.assertIs(AttentionInterface._global_mapping["treepack"], tpt.tree_attention)
        from support import tiny_model

        model = tiny_model("llama", torch.float32)
        with self.assertRaises(TreepackError) as cm:  # a model call without the tree mask never runs causal
            model(torch.tensor([[1, 2, 3]]))
        self.assertEqual(cm.exception.field, "attention_mask")


if __name__ == "__main__":
    unittest.main()
