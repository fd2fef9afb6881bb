"""Node logprobs: the LM head run only at logit nodes, in chunks, equals the gather from full logits (values,
entropies and gradients, model and hidden-state inputs; the linear head's hand-written backward and any other head
module's autograd path; softcap and temperature; a bias, a frozen head, a second backward); only the requested nodes
are scored; a model whose vocabulary is smaller than an id, or a bad argument, is a TreepackError naming the field."""

import unittest

from support import forests, needs_torch, pack, tiny_model, torch, tpt
from treepack import TreepackError

if torch is not None:

    class Wrapped(torch.nn.Module):
        """A head module that is not a plain nn.Linear (as a quantized or adapter-wrapped head is not)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            return self.inner(h)


@needs_torch(transformers=True)
class NodeLogprobs(unittest.TestCase):
    def setUp(self):
        self.batch = tpt.load_microbatch(pack(forests(97, seed=9)["mixed"] + forests(97, seed=9)["wide"], pad=2, seed=9))
        self.model = tiny_model("qwen3", torch.float64)

    def full_logits_reference(self, nodes):
        b = self.batch
        out = self.model(
            b.input_ids[None], position_ids=b.position_ids[None], attention_mask=tpt.tree_mask(b, mode="dense"), use_cache=False
        )
        logp = torch.log_softmax(out.logits[0], -1)
        lp = logp[b.parent[nodes], b.input_ids[nodes]]
        ent = -(logp.exp() * logp).sum(-1)[b.parent[nodes]]
        return lp, ent

    def test_head_at_nodes_equals_full_logits_values_and_gradients(self):
        b = self.batch
        for nodes in ("trainable", "all"):
            for chunk in (1, 7, 4096):
                with self.subTest(nodes=nodes, chunk=chunk):
                    self.model.zero_grad()
                    s = tpt.packed_logprobs(self.model, b, chunk_size=chunk, entropy=True, nodes=nodes)
                    want = tpt.scored_nodes(b, nodes)
                    self.assertTrue(torch.equal(s.nodes, want))
                    unscored = torch.ones(b.num_nodes, dtype=torch.bool)
                    unscored[want] = False
                    self.assertTrue(torch.isnan(s.logprobs[unscored]).all() and torch.isnan(s.entropy[unscored]).all())
                    (s.logprobs[want].sum() + 0.3 * s.entropy[want].sum()).backward()
                    grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
                    self.model.zero_grad()
                    lp, ent = self.full_logits_reference(want)
                    (lp.sum() + 0.3 * ent.sum()).backward()
                    self.assertLess(float((s.logprobs[want] - lp).abs().max()), 1e-12)
                    self.assertLess(float((s.entropy[want] - ent).abs().max()), 1e-12)
                    for n, p in self.model.named_parameters():
                        self.assertLess(float((grads[n] - p.grad).abs().max()), 1e-10, n)

    def test_trainable_nodes_are_the_targets_of_trainable_occurrences(self):
        b = self.batch
        nodes = tpt.scored_nodes(b)
        self.assertEqual(set(nodes.tolist()), {int(b.seq_positions[j]) for j in range(b.num_occurrences) if b.loss_mask[j]})
        occ = tpt.gather_occurrences(tpt.packed_logprobs(self.model, b).logprobs, b)
        self.assertFalse(torch.isnan(occ[b.loss_mask]).any())

    def test_hidden_state_input(self):
        b = self.batch
        hidden = self.model.model(
            input_ids=b.input_ids[None], position_ids=b.position_ids[None], attention_mask=tpt.tree_mask(b)
        ).last_hidden_state
        from_hidden = tpt.packed_logprobs(hidden, b, lm_head=self.model.lm_head, nodes="all", chunk_size=3)
        from_model = tpt.packed_logprobs(self.model, b, nodes="all")
        self.assertTrue(torch.equal(from_hidden.nodes, from_model.nodes))
        self.assertLess(float((from_hidden.logprobs[from_model.nodes] - from_model.logprobs[from_model.nodes]).abs().max()), 1e-12)

    def test_sdpa_model_takes_the_dense_tree_mask(self):
        b = self.batch
        sdpa = tiny_model("qwen3", torch.float64, attn="sdpa")
        got = tpt.packed_logprobs(sdpa, b, nodes="all")
        want = tpt.packed_logprobs(self.model, b, nodes="all")
        self.assertLess(float((got.logprobs[want.nodes] - want.logprobs[want.nodes]).abs().max()), 1e-12)

    def test_softcap_and_temperature_both_head_paths(self):
        # The sampler's logits: softcapped, then divided by the temperature; a head that is not a plain nn.Linear
        # (here wrapped) takes the autograd path, which must agree with the linear head's hand-written backward.
        b, T, cap = self.batch, 0.7, 0.5
        self.model.config.final_logit_softcapping = cap
        linear = self.model.lm_head
        for wrapped in (False, True):
            for chunk in (7, 4096):  # several chunks (recomputed in backward), one (kept)
                with self.subTest(wrapped=wrapped, chunk=chunk):
                    self.model.lm_head = Wrapped(linear) if wrapped else linear
                    self.model.zero_grad()
                    s = tpt.packed_logprobs(self.model, b, chunk_size=chunk, entropy=True, temperature=T)
                    want = s.nodes
                    (s.logprobs[want].sum() + 0.3 * s.entropy[want].sum()).backward()
                    grads = {id(p): p.grad.clone() for p in self.model.parameters()}  # by tensor: wrapping renames the head's
                    self.model.zero_grad()
                    self.model.lm_head = linear
                    out = self.model(
                        b.input_ids[None], position_ids=b.position_ids[None], attention_mask=tpt.tree_mask(b, mode="dense"), use_cache=False
                    )
                    logp = torch.log_softmax(cap * torch.tanh(out.logits[0] / cap) / T, -1)
                    lp = logp[b.parent[want], b.input_ids[want]]
                    ent = -(logp.exp() * logp).sum(-1)[b.parent[want]]
                    (lp.sum() + 0.3 * ent.sum()).backward()
                    self.assertLess(float((s.logprobs[want] - lp).abs().max()), 1e-12)
                    self.assertLess(float((s.entropy[want] - ent).abs().max()), 1e-12)
                    for n, p in self.model.named_parameters():
                        self.assertLess(float((grads[id(p)] - p.grad).abs().max()), 1e-10, n)

    def test_linear_head_with_bias_frozen_head_and_second_backward(self):
        b = self.batch
        torch.manual_seed(3)
        hidden = torch.randn(b.num_nodes, 16, dtype=torch.float64)
        head = torch.nn.Linear(16, 97, bias=True).double()
        nodes = tpt.scored_nodes(b, "all")

        def reference(h):
            logp = torch.log_softmax(head(h), -1)
            return logp[b.parent[nodes], b.input_ids[nodes]], -(logp.exp() * logp).sum(-1)[b.parent[nodes]]

        weights = torch.randn(nodes.numel(), dtype=torch.float64)
        for frozen in (False, True):
            head.requires_grad_(not frozen)
            for chunk in (5, 4096):
                for entropy in (False, True):
                    with self.subTest(frozen=frozen, chunk=chunk, entropy=entropy):
                        h = hidden.clone().requires_grad_(True)
                        s = tpt.packed_logprobs(h, b, lm_head=head, nodes="all", chunk_size=chunk, entropy=entropy)
                        objective = (weights * s.logprobs[nodes]).sum() + (0.3 * s.entropy[nodes].sum() if entropy else 0)
                        params = [h] + ([] if frozen else [head.weight, head.bias])
                        got = torch.autograd.grad(objective, params, retain_graph=True)
                        again = torch.autograd.grad(objective, params)  # a kept chunk's saved tensors are read, not overwritten
                        h_ref = hidden.clone().requires_grad_(True)
                        lp, ent = reference(h_ref)
                        ref_objective = (weights * lp).sum() + (0.3 * ent.sum() if entropy else 0)
                        want = torch.autograd.grad(ref_objective, [h_ref] + params[1:])
                        self.assertLess(float((s.logprobs[nodes] - lp).abs().max()), 1e-12)
                        for g, g2, w in zip(got, again, want):
                            self.assertLess(float((g - w).abs().max()), 1e-10)
                            self.assertTrue(torch.equal(g, g2))
        head.requires_grad_(True)  # no node scored: a zero gradient, not an unwritten one
        none = tpt.packed_logprobs(hidden, b, lm_head=head, nodes=torch.zeros(0, dtype=torch.int64))
        self.assertTrue(torch.isnan(none.logprobs).all())
        (g_w,) = torch.autograd.grad(none.logprobs[none.nodes].sum(), [head.weight])
        self.assertTrue(torch.equal(g_w, torch.zeros_like(g_w)))

    def test_bfloat16_head_matches_the_autograd_path(self):
        # A head in another dtype than the logits (float32): cast after the matmul, its gradient cast back, as
        # autograd does.
        b = self.batch
        torch.manual_seed(4)
        hidden = torch.randn(b.num_nodes, 16).bfloat16()
        head = torch.nn.Linear(16, 97, bias=False).bfloat16()
        results = []
        for lm_head in (head, Wrapped(head)):
            h = hidden.clone().requires_grad_(True)
            s = tpt.packed_logprobs(h, b, lm_head=lm_head, nodes="all", chunk_size=9, entropy=True)
            self.assertEqual(s.logprobs.dtype, torch.float32)
            (s.logprobs[s.nodes].sum() + s.entropy[s.nodes].sum()).backward()
            results.append((s.logprobs[s.nodes].detach(), h.grad.float(), head.weight.grad.float()))
            head.weight.grad = None
        for got, want in zip(*results):
            self.assertLess(float((got - want).abs().max()), 2e-2 * max(1.0, float(want.abs().max())))

    def test_a_model_of_another_vocabulary_is_refused(self):
        # The header's vocab_size is the packing tokenizer's: rows up to VOCAB_PADDING beyond it are a model's padding;
        # fewer rows, or many more, mean another model's tokenizer made the ids (which may all still be in range).
        big = tiny_model("qwen3", torch.float64, vocab=3000)
        b = self.batch
        for vocab, ok in (
            (3000, True),
            (3000 - tpt.logprobs.VOCAB_PADDING, True),
            (3001, False),
            (3000 - tpt.logprobs.VOCAB_PADDING - 1, False),
        ):
            with self.subTest(vocab=vocab):
                b.meta["vocab_size"] = vocab
                if ok:
                    self.assertEqual(tpt.packed_logprobs(big, b).logprobs.shape, (b.num_nodes,))
                else:
                    with self.assertRaises(TreepackError) as cm:
                        tpt.packed_logprobs(big, b)
                    self.assertEqual(cm.exception.field, "vocab_size")
                    self.assertIn(f"of {vocab} ids, but Qwen3ForCausalLM embeds 3000 rows", str(cm.exception))
        del b.meta["vocab_size"]
        tpt.packed_logprobs(big, b)  # unknown (pre-tokenized input without --vocab-size): only the ids are checked

    def test_errors_name_the_field(self):
        b = self.batch
        small = tiny_model("llama", torch.float64, vocab=int(b.input_ids.max()))  # the largest id is out of range
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(small, b)
        self.assertEqual(cm.exception.field, "input_ids")
        hidden = torch.zeros(b.num_nodes, 32, dtype=torch.float64)
        head = torch.nn.Linear(32, int(b.input_ids.max()), bias=False).double()
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(hidden, b, lm_head=head, nodes="all")
        self.assertEqual(cm.exception.field, "input_ids")
        for kwargs, field in (
            ({"chunk_size": 0}, "chunk_size"),
            ({"nodes": "some"}, "nodes"),
            ({"nodes": torch.tensor([0])}, "nodes"),  # a root predicts nothing
            ({"temperature": 0}, "temperature"),
        ):
            with self.subTest(field=field):
                with self.assertRaises(TreepackError) as cm:
                    tpt.packed_logprobs(self.model, b, **kwargs)
                self.assertEqual(cm.exception.field, field)
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(hidden, b)
        self.assertEqual(cm.exception.field, "lm_head")
        with self.assertRaises(TreepackError) as cm:
            tpt.packed_logprobs(hidden[:-1], b, lm_head=head)
        self.assertEqual(cm.exception.field, "hidden")
        with self.assertRaises(TreepackError) as cm:
            tpt.gather_occurrences(torch.zeros(3), b)
        self.assertEqual(cm.exception.field, "node_values")


if __name__ == "__main__":
    unittest.main()
