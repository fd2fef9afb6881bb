"""Sliding-window and sink attention on a tree (docs/design.md §8): k an ancestor-or-self of q and
``position_ids[q] - position_ids[k] < window`` (transformers' ``sliding_window``), sinks a per-head logit in every
row's softmax denominator (gpt-oss ``s_aux``).

Lowerings: the windowed block arrays equal those torch derives from a brute-force windowed ancestor mask (walked up
the parent chain, independent of subtree_end); dense and block attention (forward and the gradients of q, k, v and
the sinks) equal a plain float64 softmax over that mask with the sink column (compiled flex with windows and sinks:
python/tests/gpu/test_flex_compiled.py).

Models (float64, tiny random weights of the real transformers classes): gpt-oss (sliding + full layers, sinks, MoE
with the "eager" experts, which run float64 where grouped_mm refuses it), Gemma 3 and Gemma 4 text (sliding + full;
Gemma 4 with a KV-shared layer) and DeepSeek-V3 (MLA, no window: the plain path) run packed (attention "treepack" in
block mode with 2-token tiles so that partial, full and dropped tiles all occur, in dense mode, and the sdpa/eager dense-mask path of
packed_logprobs) equal the unpacked run (each sequence alone, stock attention): per-token logprobs, entropies, the
loss, the gradient of every token's input embedding and of every parameter within 1e-10. gpt-oss in float32 with
the stock grouped_mm experts: within 1e-5 (measured ~5e-7). A negative control: the old dense path (one unwindowed
tree mask for every layer) differs. Mismatched configs are TreepackErrors naming the layer."""

import copy
import random
import types
import unittest

import numpy as np
from support import forests, needs_torch, pack, patch_norms_to_input_dtype, tiny_model, torch, tpt

# isort: split
# support (above) puts python/tests on sys.path, where mask_reference lives
from mask_reference import block_arrays_from_dense
from test_exactness import objective
from treepack import TreepackError
from treepack.flex import block_arrays_from_tree, block_arrays_windowed

VOCAB = 97


def gpt_oss_float32():
    """gpt-oss in float32 with the stock grouped_mm experts (which refuse float64), its unpacked twin, a packed forest of
    branches and the mask of its trained occurrences."""
    model, plain, _ = build("gpt_oss")
    for m in (model, plain):
        m.float().set_experts_implementation("grouped_mm")
    batch = tpt.load_microbatch(pack(window_forests(seed=3)["branches"], pad=1))
    return model, plain, batch, batch.token_index > 0


def window_forests(seed=0):
    """Segments longer than the windows tested, branch points at depths 2, 6, 10, 11 and 12 of a 12-token stem (a
    small window's queries see back past some and not others), a duplicate, a lone 1-token root, and a long shared
    chain; plus two of the shapes every equality test runs on."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(12)
    branches = [stem[:2] + tok(10), stem[:6] + tok(4), stem[:10] + tok(3), stem[:11] + tok(1), stem + tok(6), stem + tok(2), tok(1)]
    branches.append(list(branches[0]))
    chain = tok(60)
    out = {"branches": branches, "chain": [chain + tok(6), chain[:40] + tok(9)]}
    base = forests(VOCAB, seed=seed)
    out.update(deep=base["deep"], mixed=base["mixed"])
    return out


def brute_mask(parent, position_ids, window):
    """bool [N, N]: k on q's root path (walked through parent), and within the window when one is given."""
    parent, pos = np.asarray(parent), np.asarray(position_ids)
    n = len(parent)
    m = np.zeros((n, n), dtype=bool)
    for q in range(n):
        k = q
        while k >= 0:
            m[q, k] = window is None or pos[q] - pos[k] < window
            k = parent[k]
    return m


def reference_attention(q, k, v, mask, scale, sinks=None):
    """Plain float64 softmax attention over a dense bool mask, with the sink logit as one more column (gpt-oss's
    eager attention)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(1, -1, s.shape[2], 1)], dim=-1)
    return torch.softmax(s, dim=-1)[..., : k.shape[2]] @ v


def qkv_sinks(n, seed=0, heads=4, kv_heads=2, dim=8, dv=6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, n, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, n, dv, generator=g, dtype=torch.float64, requires_grad=True)  # Dv != D, as in MLA
    sinks = torch.randn(heads, generator=g, dtype=torch.float64).mul_(2).requires_grad_(True)
    return q, k, v, sinks


WINDOWS = (1, 2, 3, 5, 8, 1000)  # 1000: wider than every tree


@needs_torch()
class WindowLowerings(unittest.TestCase):
    def batches(self):
        for seed, (shape, seqs) in enumerate(window_forests(seed=1).items()):
            yield shape, tpt.load_microbatch(pack(seqs, pad=seed % 3, seed=seed))

    def test_windowed_block_arrays_equal_the_brute_force_mask(self):
        for shape, b in self.batches():
            for W in WINDOWS:
                dense = brute_mask(b.parent.numpy(), b.position_ids.numpy(), W)
                self.assertTrue(np.array_equal(tpt.dense_tree_mask(b.subtree_end, b.position_ids, W).numpy(), dense))
                for B in (1, 3, 4, 16):
                    with self.subTest(forest=shape, window=W, block_size=B):
                        got = block_arrays_windowed(b.subtree_end.numpy(), b.position_ids.numpy(), W, B)
                        want = block_arrays_from_dense(dense, B)
                        for a, c in zip(got[1:], want[1:]):
                            self.assertTrue(np.array_equal(a, c))
                        mask = tpt.windowed(tpt.tree_mask(b, mode="block", block_size=B), W)
                        self.assertTrue(np.array_equal(mask.kv_num_blocks[0, 0].numpy(), want.kv_num_blocks))
                        self.assertTrue(np.array_equal(mask.full_kv_indices[0, 0].numpy(), want.full_kv_indices))

    def test_block_lists_drop_tiles_outside_the_window(self):
        b = tpt.load_microbatch(pack(window_forests(seed=1)["chain"][:1]))  # one 66-token chain
        B, W = 4, 9
        tree = block_arrays_from_tree(b.subtree_end.numpy(), B)
        win = block_arrays_windowed(b.subtree_end.numpy(), b.position_ids.numpy(), W, B)
        listed = lambda a: int(a.kv_num_blocks.sum() + a.full_kv_num_blocks.sum())  # noqa: E731
        self.assertGreater(int(win.kv_num_blocks.sum()), 0)  # partial tiles
        self.assertGreater(int(win.full_kv_num_blocks.sum()), 0)  # full tiles
        self.assertLess(listed(win), listed(tree) // 2)  # dropped ones: 66 tokens, a 9-token window
        # A query row lists at most ceil((W - 1) / B) + 1 tiles: O(window) work.
        self.assertLessEqual(int((win.kv_num_blocks + win.full_kv_num_blocks).max()), -(-(W - 1) // B) + 1)
        mask = tpt.tree_mask(b, mode="block", block_size=B)
        self.assertLess(tpt.executed_tiles(tpt.windowed(mask, W)), tpt.executed_tiles(mask) // 2)

    def test_dense_and_block_equal_the_reference_forward_and_backward(self):
        for shape, b in self.batches():
            for W in (1, 3, 8, 1000, None):
                dense = torch.from_numpy(brute_mask(b.parent.numpy(), b.position_ids.numpy(), W))
                for with_sinks in (False, True):
                    q, k, v, sinks = qkv_sinks(b.num_nodes, seed=W or 0)
                    s = sinks if with_sinks else None
                    ref = reference_attention(q, k, v, dense, 0.3, s)
                    seed = torch.cos(torch.arange(ref.numel(), dtype=ref.dtype)).reshape(ref.shape)
                    inputs = [q, k, v] + ([sinks] if with_sinks else [])
                    want = torch.autograd.grad(ref, inputs, seed)
                    for mode, B in (("dense", 128), ("block", 1), ("block", 3), ("block", 16)):
                        with self.subTest(forest=shape, window=W, sinks=with_sinks, mode=mode, block_size=B):
                            out = tpt.attend(tpt.tree_mask(b, mode=mode, block_size=B), q, k, v, scale=0.3, window=W, sinks=s)
                            got = torch.autograd.grad(out, inputs, seed)
                            self.assertLess(float((out - ref).abs().max()), 1e-12)
                            for g, w in zip(got, want):
                                self.assertLess(float((g - w).abs().max()), 1e-12)

    def test_step_plan_rows_with_sinks(self):
        # Query rows [rows, N) only (a step plan's cached prefix), starting inside a block: the reference's rows.
        for shape, b in self.batches():
            if shape not in ("branches", "mixed"):
                continue
            q, k, v, sinks = qkv_sinks(b.num_nodes, seed=5)
            dense = torch.from_numpy(brute_mask(b.parent.numpy(), b.position_ids.numpy(), 3))
            ref = reference_attention(q, k, v, dense, 0.3, sinks)
            for rows in (1, 5):
                seed = torch.cos(torch.arange(ref[:, :, rows:].numel(), dtype=ref.dtype)).reshape(ref[:, :, rows:].shape)
                want = torch.autograd.grad(ref[:, :, rows:], (q, k, v, sinks), seed, retain_graph=True)
                for mode, B in (("dense", 128), ("block", 3)):
                    with self.subTest(forest=shape, rows=rows, mode=mode):
                        out = tpt.attend(tpt.tree_mask(b, mode=mode, block_size=B), q, k, v, scale=0.3, window=3, sinks=sinks, rows=rows)
                        self.assertLess(float((out - ref[:, :, rows:]).abs().max()), 1e-12)
                        for g, w in zip(torch.autograd.grad(out, (q, k, v, sinks), seed), want):
                            self.assertLess(float((g - w).abs().max()), 1e-12)

    def test_negative_controls(self):
        # The window binds in these forests and the sinks change every row: leaving either out differs.
        b = tpt.load_microbatch(pack(window_forests(seed=1)["branches"]))
        q, k, v, sinks = qkv_sinks(b.num_nodes)
        dense = torch.from_numpy(brute_mask(b.parent.numpy(), b.position_ids.numpy(), 3))
        ref = reference_attention(q, k, v, dense, 0.3, sinks)
        mask = tpt.tree_mask(b, mode="block", block_size=4)
        self.assertGreater(float((tpt.attend(mask, q, k, v, scale=0.3, sinks=sinks) - ref).abs().max()), 1e-2)
        self.assertGreater(float((tpt.attend(mask, q, k, v, scale=0.3, window=3) - ref).abs().max()), 1e-2)

    def test_errors_name_the_field(self):
        b = tpt.load_microbatch(pack(window_forests(seed=1)["branches"]))
        q, k, v, sinks = qkv_sinks(b.num_nodes)
        bare = tpt.tree_mask(b.subtree_end)  # no position_ids
        cases = [
            ("position_ids", lambda: tpt.attend(bare, q, k, v, window=3)),
            ("sliding_window", lambda: tpt.attend(tpt.tree_mask(b), q, k, v, window=0)),
            ("sliding_window", lambda: tpt.windowed(tpt.windowed(tpt.tree_mask(b), 3), 3)),
            ("s_aux", lambda: tpt.attend(tpt.tree_mask(b), q, k, v, sinks=sinks[:2])),
            ("position_ids", lambda: tpt.tree_mask(b.subtree_end, position_ids=b.position_ids[:-1])),
        ]
        for field, fn in cases:
            with self.subTest(field=field):
                with self.assertRaises(TreepackError) as cm:
                    fn()
                self.assertEqual(cm.exception.field, field, str(cm.exception))


def build(family, window=5):
    """(packed model, unpacked model, stock attention) for a family, float64, eval, same weights."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
        cls, stock = transformers.GptOssForCausalLM, "eager"  # gpt-oss has no sdpa (sinks)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            intermediate_size=48,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
        cls, stock = transformers.Gemma3ForCausalLM, "sdpa"
    elif family == "gemma4":  # the last layer reads the keys and values of the full layer before it (KV sharing)
        cfg = transformers.Gemma4TextConfig(
            intermediate_size=48,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=1,
            **common,
        )
        cls, stock = transformers.Gemma4ForCausalLM, "sdpa"
    else:  # DeepSeek-V3: MLA attention (q/k head dim 12, v head dim 8); both layers dense MLPs
        cfg = transformers.DeepseekV3Config(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_key_value_heads=4,
            first_k_dense_replace=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            **common,
        )
        cls, stock = transformers.DeepseekV3ForCausalLM, "sdpa"
    torch.manual_seed(0)
    model = cls(copy.deepcopy(cfg)).to(torch.float64).eval()
    if family == "gpt_oss":
        model.set_experts_implementation("eager")  # grouped_mm refuses float64
        for layer in model.model.layers:  # sinks that weigh as much as a row's keys (the init's are ~0.02)
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    plain = copy.deepcopy(model)
    model.set_attn_implementation("treepack")
    plain.set_attn_implementation(stock)
    for m in (model, plain):
        patch_norms_to_input_dtype(m)
        patch_gemma_norms(m)
    return model, plain, stock


def patch_gemma_norms(model):
    """Gemma 3's RMSNorm, (1 + weight) · x / rms(x), and Gemma 4's, weight · x / rms(x) (weight optional), compute in
    float32 whatever the input dtype; this keeps them in the input dtype with the same formulas
    (support.patch_norms_to_input_dtype does the same for the Llama form)."""

    def gemma3(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def gemma4(self, x):
        normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return normed * self.weight if self.with_scale else normed

    for m in model.modules():
        forward = {"Gemma3RMSNorm": gemma3, "Gemma4RMSNorm": gemma4}.get(type(m).__name__)
        if forward is not None:
            m.forward = types.MethodType(forward, m)


class EmbeddingGrad:
    """The gradient of the loss by every token's input embedding (the embedding module's output), captured by a
    forward hook while the context is open."""

    def __init__(self, model):
        self.module, self.outputs = model.get_input_embeddings(), []

    def __enter__(self):
        def hook(module, args, out):
            out.retain_grad()
            self.outputs.append(out)

        self.handle = self.module.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def grads(self):
        return [o.grad[0] for o in self.outputs]


def unpacked_run(model, batch):
    """Per-occurrence logprobs and entropies [M] (NaN at t = 0), the loss, its parameter gradients and its per-node
    input-embedding gradient [N, D] (each occurrence's summed into its node), each sequence run alone."""
    model.zero_grad()
    lps, ents = [], []
    with EmbeddingGrad(model) as emb:
        for i in range(batch.num_sequences):
            a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
            toks = batch.input_ids[batch.seq_positions[a:b]]
            logits = model(toks[None], use_cache=False).logits[0, :-1]
            logp = torch.log_softmax(logits, -1)
            nan = torch.full((1,), float("nan"), dtype=torch.float64)
            lps.append(torch.cat([nan, logp.gather(1, toks[1:, None])[:, 0]]))
            ents.append(torch.cat([nan, -(logp.exp() * logp).sum(-1)]))
        lp, ent = torch.cat(lps), torch.cat(ents)
        loss = objective(lp, ent, batch)
        loss.backward()
        per_occ = torch.cat(emb.grads())
    node_grad = torch.zeros(batch.num_nodes, per_occ.shape[1], dtype=per_occ.dtype).index_add_(0, batch.seq_positions, per_occ)
    return lp, ent, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, node_grad


@needs_torch(transformers=True)
class WindowedModels(unittest.TestCase):
    def run_packed(self, model, batch, how):
        """The same quantities through one packed forward: ``how`` is (mode, block size) on attention "treepack",
        or "dense-path" (packed_logprobs on the stock sdpa/eager model)."""
        model.zero_grad()
        with EmbeddingGrad(model) as emb:
            if how == "dense-path":
                scores = tpt.packed_logprobs(model, batch, nodes="all", entropy=True, chunk_size=7)
            else:
                mode, B = how
                base = model.model
                mask = tpt.tree_mask(batch, mode=mode, block_size=B)
                hidden = base(
                    input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask, use_cache=False
                ).last_hidden_state
                scores = tpt.packed_logprobs(hidden, batch, lm_head=model.lm_head, nodes="all", entropy=True, chunk_size=7)
            lp, ent = tpt.gather_occurrences(scores.logprobs, batch), tpt.gather_occurrences(scores.entropy, batch)
            loss = objective(lp, ent, batch)
            loss.backward()
            (node_grad,) = emb.grads()
        return lp, ent, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, node_grad

    def check_family(self, family, shapes, hows, window=5):
        packed, plain, stock = build(family, window)
        stock_packed = copy.deepcopy(plain)
        for seed, shape in enumerate(shapes):
            batch = tpt.load_microbatch(pack(window_forests(seed=3)[shape], pad=1 + seed % 2, seed=seed))
            want = unpacked_run(plain, batch)
            t = batch.token_index > 0
            for how in hows:
                with self.subTest(family=family, forest=shape, how=how):
                    got = self.run_packed(stock_packed if how == "dense-path" else packed, batch, how)
                    self.assertLess(float((got[0][t] - want[0][t]).abs().max()), 1e-10)
                    self.assertLess(float((got[1][t] - want[1][t]).abs().max()), 1e-10)
                    self.assertLess(abs(float(got[2] - want[2])), 1e-10)
                    for name, g in want[3].items():
                        self.assertLess(float((got[3][name] - g).abs().max()), 1e-10, name)
                    self.assertLess(float((got[4] - want[4]).abs().max()), 1e-10)
        return packed, plain, batch, want

    def assert_tiles_of_every_kind(self, batch, window, B):
        """The windowed block lists at this batch have partial and full tiles, and drop some the tree lists."""
        tree = block_arrays_from_tree(batch.subtree_end.numpy(), B)
        win = block_arrays_windowed(batch.subtree_end.numpy(), batch.position_ids.numpy(), window, B)
        self.assertGreater(int(win.kv_num_blocks.sum()), 0)
        self.assertGreater(int(win.full_kv_num_blocks.sum()), 0)
        self.assertLess(
            int(win.kv_num_blocks.sum() + win.full_kv_num_blocks.sum()), int(tree.kv_num_blocks.sum() + tree.full_kv_num_blocks.sum())
        )

    def test_gpt_oss_sliding_window_sinks_moe(self):
        packed, plain, batch, want = self.check_family("gpt_oss", ("branches", "chain"), (("block", 2), ("dense", 128), "dense-path"))
        self.assert_tiles_of_every_kind(batch, 5, 2)
        self.assertTrue(bool((packed.model.layers[0].self_attn.sinks.grad != 0).all()))  # the sinks are trained
        t = batch.token_index > 0
        # The model's own top-level forward (a wrapper's way in) with the TreeMask and logits_to_keep as an index tensor.
        with torch.no_grad():
            rows = torch.unique(batch.parent[batch.parent >= 0])
            mask = tpt.tree_mask(batch, mode="block", block_size=2)
            logits = packed(
                input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask, logits_to_keep=rows
            ).logits[0]
            hidden = packed.model(
                input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask
            ).last_hidden_state[0]
        self.assertLess(float((logits - packed.lm_head(hidden[rows])).abs().max()), 1e-12)
        # Negative control: the old dense path, one unwindowed tree mask for every layer, differs from unpacked.
        mask = tpt.dense_tree_mask(batch.subtree_end)[None, None]
        additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill_(~mask, torch.finfo(torch.float64).min)
        with torch.no_grad():
            hidden = plain.model(
                input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=additive
            ).last_hidden_state
            lp = tpt.gather_occurrences(tpt.packed_logprobs(hidden, batch, lm_head=plain.lm_head, nodes="all").logprobs, batch)
        self.assertGreater(float((lp[t] - want[0][t]).abs().max()), 1e-3)

    def test_gpt_oss_float32_stock_experts(self):
        # float32 with the stock grouped_mm experts (which refuse float64): packed equals unpacked to float32 rounding;
        # measured 4.8e-7 on logprobs and 6.6e-7 relative on gradients, bound 1e-5.
        model, plain, batch, t = gpt_oss_float32()
        lps = []
        for i in range(batch.num_sequences):
            a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
            toks = batch.input_ids[batch.seq_positions[a:b]]
            logp = torch.log_softmax(plain(toks[None], use_cache=False).logits[0, :-1].float(), -1)
            lps.append(torch.cat([torch.full((1,), float("nan")), logp.gather(1, toks[1:, None])[:, 0]]))
        lp_u = torch.cat(lps)
        lp_u[t].sum().backward()
        lp = tpt.gather_occurrences(tpt.packed_logprobs(model, batch, nodes="all", attention="block").logprobs, batch)
        lp[t].sum().backward()
        self.assertLess(float((lp[t] - lp_u[t]).abs().max()), 1e-5)
        grads = dict(model.named_parameters())
        for name, p in plain.named_parameters():
            self.assertLess(float((grads[name].grad - p.grad).abs().max()), 1e-5 * float(p.grad.abs().max()), name)

    def test_gemma3_sliding_window(self):
        _, _, batch, _ = self.check_family("gemma3", ("branches", "mixed"), (("block", 2), ("dense", 128), "dense-path"))
        self.assert_tiles_of_every_kind(batch, 5, 2)
        self.check_family("gemma3", ("deep",), (("block", 2), "dense-path"), window=1000)  # wider than the tree

    def test_gemma4_sliding_window_and_kv_sharing(self):
        _, _, batch, _ = self.check_family("gemma4", ("branches",), (("block", 2), "dense-path"))
        self.assert_tiles_of_every_kind(batch, 5, 2)

    def test_deepseek_v3_mla_plain_path(self):
        self.check_family("deepseek_v3", ("deep",), (("block", 2), "dense-path"))

    def test_window_wider_than_the_tree_and_the_mask_mapping(self):
        # A window no position difference reaches: the dense path passes the one plain mask; a binding one, a
        # {layer type: mask} mapping whose sliding entry is the windowed rule.
        _, plain, _ = build("gemma3", window=1000)
        self.assertEqual(tpt.layer_windows(plain), [1000, None])
        batch = tpt.load_microbatch(pack(window_forests(seed=3)["branches"]))
        self.assertIsInstance(tpt.dense_model_mask(plain, batch), torch.Tensor)
        plain.config.sliding_window = 3
        masks = tpt.dense_model_mask(plain, batch)
        self.assertEqual(set(masks), {"full_attention", "sliding_attention"})
        self.assertTrue(
            torch.equal(masks["sliding_attention"][0, 0], torch.from_numpy(brute_mask(batch.parent.numpy(), batch.position_ids.numpy(), 3)))
        )
        self.assertTrue(
            torch.equal(masks["full_attention"][0, 0], torch.from_numpy(brute_mask(batch.parent.numpy(), batch.position_ids.numpy(), None)))
        )

    def test_eager_dense_path_takes_an_additive_mask(self):
        # eager adds its mask to the scores: a bool mask there adds 0 or 1 (logprobs off by ~0.1), never masks.
        b = tpt.load_microbatch(pack(window_forests(seed=3)["mixed"], pad=2))
        want = tpt.packed_logprobs(tiny_model("qwen3", torch.float64), b, nodes="all").logprobs
        got = tpt.packed_logprobs(tiny_model("qwen3", torch.float64, attn="eager"), b, nodes="all").logprobs
        k = ~torch.isnan(want)
        self.assertTrue(torch.equal(k, ~torch.isnan(got)))
        self.assertLess(float((got[k] - want[k]).abs().max()), 1e-6)  # Qwen3's eager softmax runs in float32

    def test_mismatched_configs_name_the_layer(self):
        import transformers

        batch = tpt.load_microbatch(pack(window_forests(seed=3)["branches"]))
        packed, plain, _ = build("gpt_oss")

        def forward(model, mask=None):
            return model.model(
                input_ids=batch.input_ids[None],
                position_ids=batch.position_ids[None],
                attention_mask=tpt.tree_mask(batch) if mask is None else mask,
                use_cache=False,
            )

        attn = packed.model.layers[0].self_attn
        n = batch.num_nodes
        q, k, v = (
            torch.zeros(1, 4, n, 8, dtype=torch.float64),
            torch.zeros(1, 2, n, 8, dtype=torch.float64),
            torch.zeros(1, 2, n, 8, dtype=torch.float64),
        )
        bad_type = copy.deepcopy(packed)
        bad_type.config.layer_types = ["chunked_attention", "full_attention"]  # gpt-oss's own forward has no mask for it
        bad_attn = bad_type.model.layers[0].self_attn
        bad_dense = copy.deepcopy(plain)
        bad_dense.config.layer_types = ["sliding_attention", "chunked_attention"]
        gemma, gemma_plain, _ = build("gemma3")
        bidirectional = copy.deepcopy(gemma)
        bidirectional.config.use_bidirectional_attention = True

        class NoMapping(type(gemma_plain.model)):
            def forward(self, *args, **kwargs):  # a wrapper that takes no {layer type: mask} mapping
                return super().forward(*args, **kwargs)

        no_mapping = copy.deepcopy(gemma_plain)
        no_mapping.model.__class__ = NoMapping
        cases = [
            (
                "layer 0 (GptOssAttention)",
                "layer_types",
                lambda: tpt.tree_attention(bad_attn, q, k, v, tpt.tree_mask(batch), sliding_window=5),
            ),
            ("layer 1 (GptOssAttention)", "layer_types", lambda: tpt.packed_logprobs(bad_dense, batch)),
            ("layer 0 (GptOssAttention)", "position_ids", lambda: forward(packed, tpt.tree_mask(batch.subtree_end))),
            (
                "layer 0 (GptOssAttention)",
                "sliding_window",
                lambda: tpt.tree_attention(attn, q, k, v, tpt.tree_mask(batch), sliding_window=None),
            ),
            (
                "layer 0 (GptOssAttention)",
                "sliding_window",
                lambda: tpt.tree_attention(attn, q, k, v, tpt.tree_mask(batch), sliding_window=7),
            ),
            (
                "layer 0 (GptOssAttention)",
                "s_aux",
                lambda: tpt.tree_attention(attn, q, k, v, tpt.tree_mask(batch), sliding_window=5, s_aux=torch.zeros(3)),
            ),
            (
                "layer 0 (GptOssAttention)",
                "softcap",
                lambda: tpt.tree_attention(attn, q, k, v, tpt.tree_mask(batch), sliding_window=5, softcap=30.0),
            ),
            ("layer 0 (Gemma3Attention)", "use_bidirectional_attention", lambda: forward(bidirectional)),
            ("layer 0 (Gemma3Attention)", "attn_implementation", lambda: tpt.packed_logprobs(no_mapping, batch)),
        ]
        self.assertIsNotNone(transformers)
        for where, field, fn in cases:
            with self.subTest(field=field, where=where):
                with self.assertRaises(TreepackError) as cm:
                    fn()
                self.assertEqual(cm.exception.field, field, str(cm.exception))
                self.assertIn(where, str(cm.exception))


if __name__ == "__main__":
    unittest.main()
