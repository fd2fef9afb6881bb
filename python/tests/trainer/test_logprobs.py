"""Node logprobs: the LM head run only at logit nodes, in chunks, equals the gather from full logits (values,
entropies and gradients, model and hidden-state inputs); only the requested nodes are scored; a model whose
vocabulary is smaller than an id, or a bad argument, is a TreepackError naming the field."""

import unittest

from support import forests, needs_torch, pack, tiny_model, torch, tpt
from treepack import TreepackError


@needs_torch(transformers=True)
class NodeLogprobs(unittest.TestCase):
    def setUp(self):
        self.batch = tpt.load_microbatch(pack(forests(97, seed=9)["mixed"] + forests(97, seed=9)["wide"], pad=2, seed=9))
        self.model = tiny_model("qwen3", torch.float64)

    def full_logits_reference(self, nodes):
        b = self.batch
        out = self.model(b.input_ids[None], position_ids=b.position_ids[None], attention_mask=tpt.tree_mask(b, mode="dense"), use_cache=False)
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
        hidden = self.model.model(input_ids=b.input_ids[None], position_ids=b.position_ids[None], attention_mask=tpt.tree_mask(b)).last_hidden_state
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
