"""Mixture-of-experts models on trees (treepack.torch.moe): routing replay and the load-balancing loss.

Models (float64, tiny random weights of the real transformers classes, "eager" experts): Qwen3-MoE (2 MoE layers),
gpt-oss (sliding + full attention with sinks, 2 MoE layers) and DeepSeek-V3 (MLA; layer 0 dense, layer 1 MoE).
Packed with replay (attention "treepack", routes per node) equals unpacked with replay (each sequence alone, stock
attention, its own routes): per-token logprobs, the load-balancing loss (Qwen3-MoE, gpt-oss) and every parameter's
gradient of a loss using both, within 1e-10; on forests whose shared prefixes carry one route set, and on ones whose
sequences' routes of a shared prefix differ (``pack_routed`` splits the tree there). Negative control: packed
WITHOUT replay differs from unpacked with replay. Replaying the router's own top-k gives the stock forward bit for
bit (float32, every family and Qwen3.5-MoE's router); the load-balancing loss of a padded batch equals transformers' own ``aux_loss``; the
router classes listed as sharing a family's code do share its forward. Refused with a TreepackError naming the
layer: routes of the wrong shape, dtype, top-k or expert range, a token given one expert twice, a router treepack does
not handle (Mixtral's), replay under gradient checkpointing."""

import copy
import os
import re
import unittest

import numpy as np
from support import forests, needs_torch, pack, patch_norms_to_input_dtype, torch, tpt
from test_exactness import objective
from treepack import TreepackError

VOCAB = 61
FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def build(family, dtype=torch.float64 if torch else None, stock_attention=True):
    """(packed model, unpacked twin with stock attention): same weights, eval, eager experts; routers with weights
    large enough that every token's top-k is far from a tie."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=24,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        )
        cls, stock = transformers.Qwen3MoeForCausalLM, "sdpa"
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=8,
            num_hidden_layers=2,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
        cls, stock = transformers.GptOssForCausalLM, "eager"  # sinks: no sdpa
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            intermediate_size=24,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_key_value_heads=2,
            first_k_dense_replace=1,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            **common,
        )
        cls, stock = transformers.DeepseekV3ForCausalLM, "sdpa"
    elif family == "qwen3_5_moe":  # attention layers only: its router is what is tested here
        cfg = transformers.Qwen3_5MoeTextConfig(
            num_hidden_layers=2,
            layer_types=["full_attention"] * 2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            **common,
        )
        cls, stock = transformers.Qwen3_5MoeForCausalLM, "sdpa"
    else:  # mixtral: a router treepack does not replay
        cfg = transformers.MixtralConfig(
            intermediate_size=8, num_hidden_layers=1, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, **common
        )
        cls, stock = transformers.MixtralForCausalLM, "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).to(dtype).eval()
    model.set_experts_implementation("eager")  # grouped_mm refuses float64
    for name, p in model.named_parameters():
        if re.search(r"(gate|router)\.weight$", name):
            p.data.normal_(0.0, 1.0)
        if name.endswith("sinks"):
            p.data.normal_(0.0, 1.0)
    plain = copy.deepcopy(model)
    model.set_attn_implementation("treepack")
    plain.set_attn_implementation(stock if stock_attention else "treepack")
    if dtype == torch.float64:
        for m in (model, plain):
            patch_norms_to_input_dtype(m)
    return model, plain


def moe_shape(model):
    """(MoE layers, experts, top-k) of a model."""
    rs = [m for _, m in tpt.moe.routers(model)]
    return len(rs), rs[0].num_experts, rs[0].top_k


def random_routes(L, n, E, k, gen):
    """int64 [L, n, k]: k distinct experts per token and layer."""
    return torch.rand(L, n, E, generator=gen).argsort(-1)[..., :k]


def routed_batch(model, seqs, seed, conflicts):
    """A packed batch (one pad node) with routes per node, and each sequence's own routes [L, len, k]. Without
    conflicts every node has one route set (an engine's); with them, the odd sequences' routes differ at some shared
    tokens (a prompt re-read by a later call, routed anew) and pack_routed splits the tree there."""
    L, E, k = moe_shape(model)
    gen = torch.Generator().manual_seed(seed)
    plain = pack(seqs, pad=1, seed=seed)
    N = len(plain.input_ids)
    node_routes = random_routes(L, N, E, k, gen)
    own = []
    for i in range(len(seqs)):
        a, b = int(plain.seq_offsets[i]), int(plain.seq_offsets[i + 1])
        r = node_routes[:, torch.from_numpy(plain.seq_positions[a:b].astype(np.int64))].clone()
        if conflicts and i % 2:
            flip = torch.rand(b - a, generator=gen) < 0.4
            r[:, flip] = random_routes(L, int(flip.sum()), E, k, gen)
        own.append(r)
    if not conflicts:
        batch = tpt.load_microbatch(plain)
        batch.routes = node_routes
        return batch, own
    mb, routes = tpt.pack_routed(seqs, [r.numpy() for r in own])
    mb = pack(seqs, pad=1, seed=seed, packed=mb)
    batch = tpt.load_microbatch(mb)
    batch.routes = torch.cat([routes, random_routes(L, 1, E, k, gen)], dim=1)  # the pad node's
    return batch, own


def unpacked(plain, batch, own):
    """Per-occurrence logprobs and entropies [M] (NaN at t = 0) and the load-balancing loss's RouterOutputs of the
    unpacked batch: each sequence alone through the stock-attention twin, replaying its own routes."""
    lps, ents, logits, experts, kinds = [], [], [], [], None
    for i in range(batch.num_sequences):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        toks = batch.input_ids[batch.seq_positions[a:b]]
        with tpt.replay_routes(plain, own[i]) as routing:
            out = plain(toks[None], use_cache=False).logits[0, :-1]
        logits.append(routing.logits)
        experts.append(routing.experts())
        kinds = routing.kinds
        logp = torch.log_softmax(out, -1)
        nan = torch.full((1,), float("nan"), dtype=out.dtype)
        lps.append(torch.cat([nan, logp.gather(1, toks[1:, None])[:, 0]]))
        ents.append(torch.cat([nan, -(logp.exp() * logp).sum(-1)]))
    per_layer = tuple(torch.cat(ls) for ls in zip(*logits))
    return torch.cat(lps), torch.cat(ents), tpt.RouterOutputs(per_layer, torch.cat(experts, dim=1), kinds, None)


def has_aux(family):
    return family != "deepseek_v3"


@needs_torch(transformers=True)
class Replay(unittest.TestCase):
    def assertGradsEqual(self, packed, plain, tol):
        pn = dict(packed.named_parameters())
        for name, p in plain.named_parameters():
            self.assertIsNotNone(pn[name].grad, name)
            self.assertLessEqual(float((pn[name].grad - p.grad).abs().max()), tol, name)

    def test_packed_with_replay_equals_unpacked_with_replay(self):
        shapes = forests(VOCAB, seed=5)
        for family in FAMILIES:
            model, plain = build(family)
            for conflicts in (False, True):
                for shape in ("deep", "mixed"):
                    with self.subTest(family=family, conflicts=conflicts, forest=shape):
                        batch, own = routed_batch(model, shapes[shape], seed=len(shape), conflicts=conflicts)
                        if conflicts:  # the tree split where routes differ: more nodes than the token trie
                            self.assertGreater(batch.num_nodes, len(pack(shapes[shape], pad=1).input_ids))
                        for i, r in enumerate(own):  # every sequence replays exactly its own routes
                            a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
                            self.assertTrue(torch.equal(batch.routes[:, batch.seq_positions[a:b]], r))
                        model.zero_grad()
                        plain.zero_grad()
                        scores = tpt.packed_logprobs(model, batch, entropy=True, nodes="all")
                        lp = tpt.gather_occurrences(scores.logprobs, batch)
                        ent = tpt.gather_occurrences(scores.entropy, batch)
                        ref_lp, ref_ent, ref_router = unpacked(plain, batch, own)
                        t = batch.token_index > 0
                        self.assertLessEqual(float((lp[t] - ref_lp[t]).abs().max()), 1e-10)
                        self.assertTrue(torch.equal(scores.router.experts, batch.routes))
                        loss, ref_loss = objective(lp, ent, batch), objective(ref_lp, ref_ent, batch)
                        if has_aux(family):
                            aux, ref_aux = tpt.load_balancing_loss(scores.router, batch), tpt.load_balancing_loss(ref_router)
                            self.assertLessEqual(abs(float(aux - ref_aux)), 1e-10)
                            loss, ref_loss = loss + 0.5 * aux, ref_loss + 0.5 * ref_aux
                        loss.backward()
                        ref_loss.backward()
                        self.assertLessEqual(abs(float(loss - ref_loss)), 1e-10)
                        self.assertGradsEqual(model, plain, 1e-10)

    def test_negative_control_packed_without_replay_differs(self):
        seqs = forests(VOCAB, seed=5)["mixed"]
        for family in FAMILIES:
            with self.subTest(family=family):
                model, plain = build(family)
                batch, own = routed_batch(model, seqs, seed=1, conflicts=False)
                ref_lp = unpacked(plain, batch, own)[0]
                routes, batch.routes = batch.routes, None
                lp = tpt.gather_occurrences(tpt.packed_logprobs(model, batch, nodes="all").logprobs, batch)
                t = batch.token_index > 0
                self.assertGreater(float((lp[t] - ref_lp[t]).abs().max()), 1e-6)  # measured 1.6e-3 to 4e-2
                batch.routes = routes
                lp = tpt.gather_occurrences(tpt.packed_logprobs(model, batch, nodes="all").logprobs, batch)
                self.assertLessEqual(float((lp[t] - ref_lp[t]).abs().max()), 1e-10)

    def test_forward_logprobs_and_naive_batch_replay_too(self):
        """forward_logprobs (the wrapper-safe path, model(...) itself) replays the given routes as packed_logprobs
        does, and naive_batch carries each occurrence's routes: both equal the unpacked run with replay."""
        model, plain = build("gpt_oss")
        batch, own = routed_batch(model, forests(VOCAB, seed=5)["deep"], seed=3, conflicts=True)
        ref_lp = unpacked(plain, batch, own)[0]
        t = batch.token_index > 0
        routes, batch.routes = batch.routes, None
        scores = tpt.forward_logprobs(model, batch, nodes="all", routes=routes)
        self.assertLessEqual(float((tpt.gather_occurrences(scores.logprobs, batch)[t] - ref_lp[t]).abs().max()), 1e-10)
        self.assertTrue(torch.equal(scores.router.experts, routes))
        batch.routes = routes
        naive = tpt.naive_batch(batch)
        lp = tpt.gather_occurrences(tpt.packed_logprobs(model, naive, nodes="all").logprobs, naive)
        self.assertLessEqual(float((lp[t] - ref_lp[t]).abs().max()), 1e-10)

    def test_replaying_the_routers_own_choice_is_the_stock_forward(self):
        ids = torch.tensor([[3, 17, 5, 42, 8, 8, 29]])
        for family in FAMILIES + ("qwen3_5_moe",):
            with self.subTest(family=family):
                model = build(family, torch.float32)[1]
                with torch.no_grad():
                    stock = model(ids).logits
                    with tpt.replay_routes(model) as own:
                        recorded = model(ids).logits
                    with tpt.replay_routes(model, own.experts()) as again:
                        replayed = model(ids).logits
                self.assertTrue(torch.equal(recorded, stock))
                self.assertTrue(torch.equal(replayed, stock))
                self.assertTrue(torch.equal(again.experts(), own.experts()))

    def test_unrouted_tokens_take_the_routers_own_choice(self):
        """A token whose row is all -1 (the engine did not route it: vLLM's last token, a node no occurrence routed at)
        is routed by the router's own top-k; a row with -1 beside experts is refused naming the layer."""
        ids = torch.tensor([[3, 17, 5, 42, 8]])
        for family in FAMILIES:
            with self.subTest(family=family):
                model = build(family)[1]
                L, E, k = moe_shape(model)
                other = random_routes(L, 5, E, k, torch.Generator().manual_seed(1))
                with torch.no_grad():
                    with tpt.replay_routes(model) as own:
                        stock = model(ids).logits
                    mixed = other.clone()
                    mixed[:, [1, 4]] = -1  # tokens 1 and 4 unrouted: their own top-k; the others replayed
                    with tpt.replay_routes(model, mixed) as got:
                        out = model(ids).logits
                    expected = other.clone()
                    expected[:, [1, 4]] = own.experts()[:, [1, 4]]
                    with tpt.replay_routes(model, expected):
                        ref = model(ids).logits
                self.assertTrue(torch.equal(got.experts(), expected))
                self.assertTrue(torch.equal(out, ref))
                self.assertFalse(torch.equal(out, stock))
                partial = other.clone()
                partial[0, 2, 0] = -1
                with self.assertRaises(TreepackError) as cm:
                    with tpt.replay_routes(model, partial):
                        model(ids)
                self.assertIn("routes[0] hold expert -1", str(cm.exception))

    def test_load_balancing_loss_is_transformers_aux_loss(self):
        """A padded batch of two sequences (one left-padded) through the stock model with output_router_logits: its
        aux_loss (float32) equals load_balancing_loss of the two sequences' forest, node by occurrence count."""
        seqs = [[4, 9, 11, 2, 7], [4, 9, 30]]
        for family in ("qwen3_moe", "gpt_oss"):
            with self.subTest(family=family):
                model, plain = build(family, torch.float32)
                ids = torch.tensor([seqs[0], [0, 0] + seqs[1]])
                att = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
                want = plain(ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0), output_router_logits=True).aux_loss
                batch = tpt.load_microbatch(pack(seqs))
                self.assertLess(batch.num_nodes, batch.num_occurrences)
                got = tpt.load_balancing_loss(tpt.packed_logprobs(model, batch, router=True).router, batch)
                self.assertLessEqual(abs(float(got) - float(want)), 1e-6 * float(want))

    def test_router_families_share_their_forward(self):
        """Each class ROUTERS lists has, character for character, its family's forward (the first class listed), in
        the installed transformers: a changed router is caught here, not replayed with a stale rule."""
        import transformers

        root = os.path.dirname(transformers.models.__file__)
        forwards = {}
        for d in os.listdir(root):
            f = os.path.join(root, d, f"modeling_{d}.py")
            if not os.path.exists(f):
                continue
            with open(f, encoding="utf-8") as fh:
                src = fh.read()
            for m in re.finditer(r"^class (\w+)\(.*?\):\n(.*?)(?=^\S)", src, re.M | re.S):
                if m.group(1) in tpt.ROUTERS:
                    forwards[m.group(1)] = re.search(r"    def forward\(.*", m.group(2), re.S).group(0)
        self.assertEqual(sorted(forwards), sorted(tpt.ROUTERS))
        first = {}
        for name, kind in tpt.ROUTERS.items():
            first.setdefault(kind, name)
            self.assertEqual(forwards[name], forwards[first[kind]], f"{name} does not share {first[kind]}'s forward")

    def test_refusals_name_the_layer(self):
        model, plain = build("deepseek_v3")
        batch = tpt.load_microbatch(pack([[3, 4, 5], [3, 4, 6]]))
        N = batch.num_nodes
        good = random_routes(1, N, 4, 2, torch.Generator().manual_seed(0))
        dup = good.clone()
        dup[0, 2, 1] = dup[0, 2, 0]
        cases = [
            (good.float(), "integer tensor"),
            (good[None], f"[1, {N}, k]"),
            (torch.cat([good, good]), f"[1, {N}, k]"),
            (good[:, :-1], f"[1, {N}, k]"),
            (good[..., :1], "layer 1 (DeepseekV3TopkRouter): routes[0] give 1 experts per token, the router picks 2"),
            (good + 3, "layer 1 (DeepseekV3TopkRouter): routes[0] hold expert"),
            (good - 3, "layer 1 (DeepseekV3TopkRouter): routes[0] hold expert -"),
            (dup, "layer 1 (DeepseekV3TopkRouter): routes[0] give token 2 the same expert twice"),
        ]
        for routes, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(TreepackError) as cm:
                    tpt.packed_logprobs(model, batch, routes=routes)
                self.assertEqual(cm.exception.field, "routes")
                self.assertIn(text, str(cm.exception))
        with self.assertRaises(TreepackError) as cm:  # a forward of another length inside the block
            with tpt.replay_routes(plain, good):
                plain(torch.tensor([[3, 4]]))
        self.assertIn("layer 1 (DeepseekV3TopkRouter): routes[0] has", str(cm.exception))
        with self.assertRaises(TreepackError) as cm:
            tpt.load_balancing_loss(tpt.packed_logprobs(model, batch, routes=good).router, batch)
        self.assertEqual(cm.exception.field, "aux_loss")
        model.gradient_checkpointing_enable()
        model.train()
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(model, batch, routes=good)
        self.assertEqual(cm.exception.field, "gradient_checkpointing")
        mixtral = build("mixtral")[0]
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(mixtral, batch, routes=good)
        self.assertIn("layer 0 (model.layers.0.mlp.gate): treepack cannot replay the routes of MixtralTopKRouter", str(cm.exception))
        from support import tiny_model

        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(tiny_model("qwen3", torch.float64, vocab=VOCAB), batch, routes=good)
        self.assertIn("no mixture-of-experts router", str(cm.exception))

    def test_packed_loss_adds_the_aux_loss(self):
        model = build("qwen3_moe")[0]
        batch, _ = routed_batch(model, forests(VOCAB, seed=2)["deep"], seed=0, conflicts=False)
        scores = tpt.packed_logprobs(model, batch)
        lp = scores.logprobs.detach().requires_grad_(True)
        plain_loss, m0 = tpt.packed_loss(lp, batch, {"clip_low": 0.2})
        loss, m = tpt.packed_loss(lp, batch, {"clip_low": 0.2}, router=scores.router, aux_coef=0.25)
        aux = tpt.load_balancing_loss(scores.router, batch)
        self.assertEqual(float(loss), float(plain_loss + 0.25 * aux))
        self.assertEqual(m["aux_loss"], float(aux))
        self.assertEqual(m["loss"], float(loss))
        loss2, values = tpt.PackedLoss({"clip_low": 0.2}, aux_coef=0.25)(lp, batch, router=scores.router)
        self.assertEqual(float(loss2), float(loss))
        self.assertEqual(values.tolist(), [m[k] for k in tpt.METRICS] + [m["aux_loss"]])
        default, _ = tpt.packed_loss(lp, batch, {"clip_low": 0.2}, router=scores.router)  # the model's router_aux_loss_coef
        self.assertEqual(float(default), float(plain_loss + model.config.router_aux_loss_coef * aux))


if __name__ == "__main__":
    unittest.main()
