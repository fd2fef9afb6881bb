"""Packing changes cost, never results: tiny random-weight Qwen3 and Llama from transformers, run packed (attention
"treepack", node logprobs, unmerge) and unpacked (each sequence alone, SDPA causal), on forests with deep and wide
branching, duplicates, a sequence that is a prefix of another, and pad nodes.

float64: per-token logprobs and entropies, the loss, and every weight gradient within 1e-10. float32 with the packed
loss (packed_loss) on both sides: 1e-5."""

import unittest

from support import forests, needs_torch, pack, tiny_model, torch, tpt

VOCAB = 97
FAMILIES = ("qwen3", "llama")


def unpacked_logprobs(model, batch):
    """Per-occurrence logprobs and entropies [M] (NaN at t = 0), each sequence run alone."""
    lps, ents = [], []
    for i in range(batch.num_sequences):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        toks = batch.input_ids[batch.seq_positions[a:b]]
        nan = torch.full((1,), float("nan"), dtype=model.dtype, device=toks.device)
        if b - a < 2:
            lps.append(nan.expand(b - a))
            ents.append(nan.expand(b - a))
            continue
        logits = model(toks[None], use_cache=False).logits[0, :-1].to(model.dtype)
        logp = torch.log_softmax(logits, -1)
        lps.append(torch.cat([nan, logp.gather(1, toks[1:, None])[:, 0]]))
        ents.append(torch.cat([nan, -(logp.exp() * logp).sum(-1)]))
    return torch.cat(lps), torch.cat(ents)


def objective(lp_occ, ent_occ, batch):
    """A float64 GRPO-like objective over trainable occurrences (ratio to old, advantage, entropy bonus)."""
    m = batch.loss_mask
    A = batch.advantages.double()[m]
    old = batch.old_logprobs.double()[m]
    return (-A * torch.exp(lp_occ[m] - old) - 0.01 * ent_occ[m]).sum() / m.sum().clamp(min=1)


@needs_torch(transformers=True)
class PackedEqualsUnpacked(unittest.TestCase):
    def compare_grads(self, packed, unpacked, tol, rel=False):
        pn = dict(packed.named_parameters())
        for name, p in unpacked.named_parameters():
            g, h = pn[name].grad, p.grad
            self.assertIsNotNone(g, name)
            scale = float(h.abs().max()) if rel else 1.0
            self.assertLessEqual(float((g - h).abs().max()), tol * max(scale, 1e-30), name)

    def test_float64_logprobs_loss_and_every_weight_gradient(self):
        for family in FAMILIES:
            packed_model = tiny_model(family, torch.float64)
            plain_model = tiny_model(family, torch.float64, attn="sdpa")
            for seed, (shape, seqs) in enumerate(forests(VOCAB, seed=3).items()):
                for mode in ("block", "dense"):
                    with self.subTest(family=family, forest=shape, mode=mode):
                        batch = tpt.load_microbatch(pack(seqs, pad=1 + seed % 3, seed=seed))
                        self.assertGreater(batch.num_pad_tokens, 0)
                        packed_model.zero_grad()
                        plain_model.zero_grad()
                        scores = tpt.packed_logprobs(packed_model, batch, nodes="all", entropy=True, chunk_size=5, attention=mode)
                        lp_p = tpt.gather_occurrences(scores.logprobs, batch)
                        ent_p = tpt.gather_occurrences(scores.entropy, batch)
                        lp_u, ent_u = unpacked_logprobs(plain_model, batch)
                        t = batch.token_index > 0
                        self.assertTrue(torch.equal(torch.isnan(lp_p), ~t))  # only roots are unscored
                        self.assertLess(float((lp_p[t] - lp_u[t]).abs().max()), 1e-10)
                        self.assertLess(float((ent_p[t] - ent_u[t]).abs().max()), 1e-10)
                        loss_p, loss_u = objective(lp_p, ent_p, batch), objective(lp_u, ent_u, batch)
                        self.assertLess(abs(float(loss_p - loss_u)), 1e-10)
                        loss_p.backward()
                        loss_u.backward()
                        self.compare_grads(packed_model, plain_model, 1e-10)

    def test_float32_packed_loss_kernel(self):
        config = {"clip_low": 0.2, "clip_high": 0.28, "kl": "k3", "kl_coef": 0.01}
        for family in FAMILIES:
            packed_model = tiny_model(family, torch.float32)
            plain_model = tiny_model(family, torch.float32, attn="sdpa")
            for seed, (shape, seqs) in enumerate(forests(VOCAB, seed=5).items()):
                with self.subTest(family=family, forest=shape):
                    batch = tpt.load_microbatch(pack(seqs, pad=2, seed=seed))
                    packed_model.zero_grad()
                    plain_model.zero_grad()
                    lp = tpt.packed_logprobs(packed_model, batch).logprobs
                    loss_p, metrics_p = tpt.packed_loss(lp, batch, config)
                    lp_u, _ = unpacked_logprobs(plain_model, batch)
                    # The unpacked batch: one node per occurrence, so the same loss sees no sharing at all.
                    naive = {
                        "seq_offsets": batch.seq_offsets,
                        "seq_positions": torch.arange(batch.num_occurrences),
                        "loss_mask": batch.loss_mask,
                        "advantages": batch.advantages,
                        "old_logprobs": batch.old_logprobs,
                        "ref_logprobs": batch.ref_logprobs,
                    }
                    loss_u, metrics_u = tpt.packed_loss(lp_u, naive, config)
                    self.assertAlmostEqual(float(loss_p), float(loss_u), delta=1e-5)
                    for k in metrics_p:
                        self.assertAlmostEqual(metrics_p[k], metrics_u[k], delta=1e-5 * max(1.0, abs(metrics_u[k])), msg=k)
                    loss_p.backward()
                    loss_u.backward()
                    self.compare_grads(packed_model, plain_model, 1e-5, rel=True)


if __name__ == "__main__":
    unittest.main()
