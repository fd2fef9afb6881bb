"""The trainer adapters (treepack.torch.rows, treepack.torch.forward) against unpacked Hugging Face forwards of each
row alone (float64): padded and jagged rows → forest → ``forward_logprobs`` through the model's own forward
(plain and a PEFT LoRA model) → rows again gives each row's logprobs, entropies and gradients; the fill is finite
where nothing is scored; ``padded_rows`` inverts the conversion; what cannot be exact is refused."""

from __future__ import annotations

import importlib.util
import unittest

from support import needs_torch, tiny_model, torch

PEFT_SKIP = "" if importlib.util.find_spec("peft") else "peft not importable (pip install -r python/requirements-integrations.txt)"

# Left-padded prompts, right-padded responses (R = 5): a duplicate row, a row whose response continues another's, a
# row with a tool token (response mask 0), an EOS-only response, a row with no response tokens.
IDS = [
    [0, 0, 5, 6, 7, 8, 9, 1, 0, 0],
    [0, 0, 5, 6, 7, 8, 9, 1, 0, 0],
    [0, 0, 5, 6, 7, 8, 9, 1, 3, 4],
    [0, 5, 6, 7, 2, 8, 11, 12, 13, 1],
    [0, 0, 0, 5, 6, 1, 0, 0, 0, 0],
    [0, 0, 0, 5, 6, 0, 0, 0, 0, 0],
]
ATT = [
    [0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
    [0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 1, 1, 1, 0, 0, 0, 0],
    [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
]
R = 5
RESP = [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def reference(model, ids, att, resp, temperature=1.0):
    """Each row alone, unpadded, through the model: [B, R] logprobs and entropies of its trainable response tokens
    (0 elsewhere), and the mask of those slots."""
    B, T = ids.shape
    lp, ent = torch.zeros(B, R, dtype=torch.float64), torch.zeros(B, R, dtype=torch.float64)
    for i in range(B):
        seq = ids[i][att[i].bool()]
        logp = (model(input_ids=seq[None]).logits[0].double() / temperature).log_softmax(-1)
        P = int(att[i, : T - R].sum())
        for k, c in enumerate(torch.nonzero(att[i, T - R :]).flatten().tolist()):
            if resp[i, c]:
                lp[i, c] = logp[P + k - 1, seq[P + k]]
                ent[i, c] = -(logp[P + k - 1].exp() * logp[P + k - 1]).sum()
    return lp, ent, (att[:, T - R :] * resp).bool()


@needs_torch(transformers=True)
class RowsTest(unittest.TestCase):
    def setUp(self):
        self.ids, self.att, self.resp = torch.tensor(IDS), torch.tensor(ATT), torch.tensor(RESP)

    def model(self, attn):
        return tiny_model("qwen3", torch.float64, attn=attn, vocab=32)

    def check_model(self, packed_model, ref_model):
        from treepack.torch import forward_logprobs, from_padded

        batch, layout = from_padded(self.ids, self.att, response_mask=self.resp)
        self.assertEqual(
            batch.num_nodes,
            len({tuple(s[: t + 1]) for s in (r[m.bool()].tolist() for r, m in zip(self.ids, self.att)) for t in range(len(s))}),
        )
        scores = forward_logprobs(packed_model, batch, temperature=0.7, entropy=True)
        lp, ent = layout.to_padded(scores.logprobs), layout.to_padded(scores.entropy)
        ref_lp, ref_ent, mask = reference(ref_model, self.ids, self.att, self.resp, 0.7)
        self.assertLess(float((lp - ref_lp).abs().max()), 1e-10)
        self.assertLess(float((ent - ref_ent).abs().max()), 1e-10)
        self.assertTrue(bool(torch.isfinite(lp).all()) and bool((lp[~mask] == 0).all()), "finite fill where not trainable")
        # Gradients through the scatter equal the unpacked ones.
        w = torch.linspace(-1, 1, lp.numel(), dtype=torch.float64).view_as(lp)
        params = [p for p in packed_model.parameters() if p.requires_grad]
        g = torch.autograd.grad((lp * w).sum(), params)
        g_ref = torch.autograd.grad(
            (reference(ref_model, self.ids, self.att, self.resp, 0.7)[0] * w).sum(), [p for p in ref_model.parameters() if p.requires_grad]
        )
        for a, b in zip(g, g_ref):
            self.assertLess(float((a - b).abs().max()), 1e-10)

    def test_padded_rows_plain_model(self):
        model = self.model("treepack")
        ref = self.model("sdpa")
        self.check_model(model, ref)

    @unittest.skipIf(bool(PEFT_SKIP), PEFT_SKIP)
    def test_peft_lora(self):
        """Through PeftModel's own forward (adapters active), equal to the LoRA model's unpacked forward."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        torch.manual_seed(1)
        packed = get_peft_model(self.model("treepack"), config)
        torch.manual_seed(1)
        ref = get_peft_model(self.model("sdpa"), config)
        self.check_model(packed, ref)
        # Negative control: without its adapters the model's logprobs differ.
        from treepack.torch import forward_logprobs, from_padded

        batch, layout = from_padded(self.ids, self.att, response_mask=self.resp)
        with torch.no_grad(), packed.disable_adapter():
            bare = layout.to_padded(forward_logprobs(packed, batch).logprobs)
        ref_lp, _, mask = reference(ref, self.ids, self.att, self.resp)
        self.assertGreater(float((bare - ref_lp)[mask].abs().max()), 1e-4)

    def test_ddp(self):
        """Through DistributedDataParallel's own forward (gloo, one process on CPU): the same logprobs, and the
        gradients reach the parameters."""
        import torch.distributed as dist
        from treepack.torch import forward_logprobs, from_padded

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            model = self.model("treepack")
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            calls = []
            ddp.register_forward_pre_hook(lambda module, args: calls.append(module))
            batch, layout = from_padded(self.ids, self.att, response_mask=self.resp)
            lp = layout.to_padded(forward_logprobs(ddp, batch, temperature=0.7).logprobs)
            ref_lp, _, _ = reference(self.model("sdpa"), self.ids, self.att, self.resp, 0.7)
            self.assertLess(float((lp.detach() - ref_lp.detach()).abs().max()), 1e-10)
            self.assertEqual(calls, [ddp])
            lp.sum().backward()
            self.assertTrue(all(p.grad is not None for p in model.parameters() if p.requires_grad))
        finally:
            dist.destroy_process_group()

    def test_jagged_equals_padded(self):
        from treepack.torch import forward_logprobs, from_jagged, from_padded

        model = self.model("treepack")
        batch, layout = from_padded(self.ids, self.att, response_mask=self.resp)
        padded = layout.to_padded(forward_logprobs(model, batch).logprobs.detach(), fill=-7.0)
        T = self.ids.shape[1]
        rows = [r[m.bool()] for r, m in zip(self.ids, self.att)]
        starts = [int(m[: T - R].sum()) for m in self.att]
        masks = [rm[m[T - R :].bool()] for rm, m in zip(self.resp, self.att)]
        lengths = [len(r) for r in rows]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        for given in (rows, (torch.cat(rows), offsets), torch.nested.nested_tensor(rows, layout=torch.jagged)):
            jb, jl = from_jagged(given, starts, masks)
            self.assertEqual(jb.num_nodes, batch.num_nodes)
            values, out_offsets = jl.to_jagged(forward_logprobs(model, jb).logprobs.detach(), fill=-7.0)
            for i in range(len(rows)):
                got = values[out_offsets[i] : out_offsets[i + 1]]
                want = padded[i][self.att[i, T - R :].bool()]
                self.assertLess(float((got - want).abs().max()) if got.numel() else 0.0, 1e-12)
            self.assertTrue(bool((values[torch.cat(masks) == 0] == -7.0).all()))

    def test_padded_rows_inverts(self):
        """A packed batch as TRL rows and back: the same forest and trainable tokens; stored floats in place."""
        from treepack.torch import from_padded, padded_rows

        batch, _ = from_padded(self.ids, self.att, response_mask=self.resp)
        batch.advantages = torch.arange(batch.num_occurrences, dtype=torch.float32)
        rows, layout = padded_rows(batch, pad_token_id=0)
        ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1)
        att = torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1)
        again, _ = from_padded(ids, att, response_mask=rows["loss_mask"])
        self.assertTrue(torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.parent, batch.parent))
        self.assertTrue(torch.equal(again.loss_mask, batch.loss_mask))
        adv = layout.to_padded(batch.advantages, of="occurrences", where="all", fill=-1.0)
        for i in range(batch.num_sequences):
            a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
            hit = torch.nonzero(batch.loss_mask[a:b]).flatten()
            s = int(hit[0]) if hit.numel() else b - a
            self.assertEqual(adv[i, : b - a - s].tolist(), batch.advantages[a + s : b].tolist())

    def test_refusals(self):
        from treepack import TreepackError
        from treepack.torch import forward_logprobs, from_padded

        with self.assertRaises(TreepackError) as e:  # a trainable token with nothing before it to predict it
            from_padded(torch.tensor([[4, 5]]), torch.tensor([[1, 1]]), response_length=2)
        self.assertEqual(e.exception.field, "response_mask")
        with self.assertRaises(TreepackError) as e:
            from_padded(self.ids, self.att, response_mask=self.resp, response_length=R)
        self.assertEqual(e.exception.field, "response_mask")
        model = self.model("sdpa")
        batch, _ = from_padded(self.ids, self.att, response_mask=self.resp)
        # A layer type no tree mask lowering handles (chunked attention) is refused by forward_logprobs as by
        # packed_logprobs (one check, logprobs.model_mask), naming the layer.
        model.config.layer_types = ["chunked_attention"] * model.config.num_hidden_layers
        with self.assertRaises(TreepackError) as e:
            forward_logprobs(model, batch)
        self.assertIn("layer 0", str(e.exception))


if __name__ == "__main__":
    unittest.main()
