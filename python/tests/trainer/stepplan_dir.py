"""Runs a packed directory written with ``treepack pack --prefix-reuse`` through the step-plan executor, rank by rank
in step order, and the same sequences as one unsplit forest; prints JSON with the largest differences in loss,
per-token logprobs and parameter gradients (float64, a tiny Qwen3 or, given FAMILY, a tiny hybrid of
test_hybrid.py: qwen3_5, nemotron_h, ...). Called by test/prefix-plan.test.ts; ``compare`` also by feed_stepplan.py.

    python stepplan_dir.py DIR [FAMILY]
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support import tiny_model, torch, tpt  # noqa: E402
from treepack.pack import pack_sequences  # noqa: E402


def loss_fn(lp, batch):
    occ = tpt.gather_occurrences(lp, batch)[batch.loss_mask]
    adv = batch.advantages[batch.loss_mask].double()
    return (adv * torch.exp(occ)).sum() + 0.1 * (occ**2).sum()


def per_sequence(lp, batch):
    occ = tpt.gather_occurrences(lp, batch)
    out = {}
    for i, sid in enumerate(batch.meta["sequence_ids"]):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        out[sid] = torch.where(batch.loss_mask[a:b], occ[a:b], torch.zeros_like(occ[a:b])).numpy()
    return out


def reference(model, batches, chunk_size=1024):
    """Every sequence of ``batches`` in one unsplit forest, with the occurrence fields the micro-batches carry: its
    loss, per-sequence logprobs and parameter gradients (the model's gradients are left zeroed)."""
    seqs, fields = [], {"loss_mask": [], "advantages": []}
    for b in batches:
        for i in range(b.num_sequences):
            a, c = int(b.seq_offsets[i]), int(b.seq_offsets[i + 1])
            seqs.append((b.meta["sequence_ids"][i], b.sequence(i).tolist()))
            fields["loss_mask"].append(b.loss_mask[a:c].numpy().astype(np.uint8))
            fields["advantages"].append(b.advantages[a:c].numpy())
    mb = pack_sequences([s for _, s in seqs])
    mb.loss_mask = np.concatenate(fields["loss_mask"])
    mb.advantages = np.concatenate(fields["advantages"])
    mb.meta["sequence_ids"] = [sid for sid, _ in seqs]
    whole = tpt.from_microbatch(mb)
    model.zero_grad(set_to_none=True)
    lp = tpt.packed_logprobs(model, whole, attention="block", chunk_size=chunk_size).logprobs
    loss = loss_fn(lp, whole)
    loss.backward()
    ref = (float(loss.detach()), per_sequence(lp.detach(), whole), {n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return ref


def differences(ref, total, got_lp, grads):
    """The largest differences of a run (its summed loss, per-sequence logprobs, gradients by name) from ``reference``."""
    loss, ref_lp, ref_grads = ref
    same = sorted(got_lp) == sorted(ref_lp)
    return {
        "loss": loss,
        "loss_diff": abs(total - loss),
        "logprob_diff": max(float(np.abs(got_lp[s] - ref_lp[s]).max()) for s in ref_lp) if same else None,
        "same_sequences": same,
        "grad_diff": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
    }


def compare(model, ranks, chunk_size=1024):
    """Each rank's micro-batches (lists, in the plan's order) through ``run_step_plan``, the ranks' gradients summed
    as an all-reduce would, against every sequence in one unsplit forest: the largest differences, and what the
    executor computed."""
    batches = [b for mine in ranks for b in mine]
    ref = reference(model, batches, chunk_size)
    total, got_lp, stats = 0.0, {}, {"computed": 0, "pushed": 0, "peak": 0}
    for mine in ranks:
        res = tpt.run_step_plan(model, mine, loss_fn, attention="block", chunk_size=chunk_size)
        total += float(sum(res.losses))
        for b, lp_i in zip(mine, res.logprobs):
            got_lp.update(per_sequence(lp_i, b))
        stats["computed"] += res.computed_tokens
        stats["pushed"] += res.pushed_tokens
        stats["peak"] = max(stats["peak"], res.peak_cached_tokens)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        **differences(ref, total, got_lp, grads),
        "computed_tokens": stats["computed"],
        "pushed_tokens": stats["pushed"],
        "peak_cached_tokens": stats["peak"],
        "pad_tokens": sum(b.num_pad_tokens for b in batches),
    }


def main(path: str, family: str = "qwen3") -> None:
    manifest = tpt.read_manifest(path)
    entries = manifest["micro_batches"]
    batches = [tpt.load_microbatch(os.path.join(path, e["file"])) for e in entries]
    vocab = 1 + max(int(b.input_ids.max()) for b in batches if b.num_nodes)
    if family == "qwen3":
        model = tiny_model("qwen3", torch.float64, vocab=max(vocab, 8))
    else:
        from test_hybrid import hybrid_model

        model = hybrid_model(family, vocab=max(vocab, 8))
    # Each rank's micro-batches in step order.
    ranks = []
    for rank in sorted({e.get("rank", 0) for e in entries}):
        ranks.append([batches[i] for _, i in sorted((e["step"], i) for i, e in enumerate(entries) if e.get("rank", 0) == rank)])
    out = compare(model, ranks)
    out["manifest"] = {k: manifest.get(k) for k in ("optimum_tokens", "computed_tokens", "pushed_tokens", "peak_cached_tokens")}
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
