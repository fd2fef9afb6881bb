"""packed_loss (the torch loss; test_torch_loss.py holds it to the C core) against a plain float64 torch implementation
of the formulas in docs/concepts/loss.md, written here with autograd on the unpacked batch (one logprob per occurrence):
every config of test/fixtures/loss_reference.json and random configs (seq_weight and loss_scale included) on random packed forests;
loss, dloss/dlp (the occurrence gradients summed per node) and every metric. Flow-GRPO against its formula on the
unmerged turns, each turn its own list of tokens. Bad inputs: a TreepackError naming the field."""

import functools
import json
import random
import unittest

from support import FIXTURE, forests, needs_torch, pack, torch, tpt
from treepack import TreepackError, pack_sequences
from treepack.loss import LossConfig


def plain_loss(lp_occ, batch, cfg):
    """float64 per-occurrence reference; lp_occ [M] a leaf. Returns (loss, metrics dict)."""
    c = {
        "policy": "ppo",
        "clip_low": 0.2,
        "clip_high": None,
        "dual_clip": 0.0,
        "log_ratio_clamp": 20.0,
        "aggregation": "token-mean",
        "norm_constant": 0.0,
        "global_tokens": 0.0,
        "global_sequences": 0.0,
        "loss_scale": 1.0,
        "kl": "none",
        "kl_coef": 0.0,
        "tis": "none",
        "tis_cap": 2.0,
        **cfg,
    }
    if c["clip_high"] is None:
        c["clip_high"] = c["clip_low"]
    f = lambda name: batch[name].double()  # noqa: E731
    m = batch["loss_mask"].bool()
    lp_occ = torch.where(m, lp_occ, 0.0)  # masked positions may hold NaN; keep it out of every derivative
    seq = torch.repeat_interleave(torch.arange(len(batch["seq_offsets"]) - 1), torch.diff(batch["seq_offsets"]))
    S = len(batch["seq_offsets"]) - 1
    n = torch.zeros(S, dtype=torch.float64).index_add_(0, seq, m.double())
    T = c["global_tokens"] or float(n.sum())
    G = c["global_sequences"] or float((n > 0).sum())
    agg = c["aggregation"]
    w_seq = {
        "token-mean": torch.full((S,), 1 / T if T else 0.0, dtype=torch.float64),
        "seq-mean-token-sum": torch.full((S,), 1 / G if G else 0.0, dtype=torch.float64),
        "seq-mean-token-mean": 1 / (G * n.clamp(min=1)),
        "seq-mean-token-sum-norm": torch.full((S,), 1 / c["norm_constant"] if c["norm_constant"] else 0.0, dtype=torch.float64),
    }[agg]
    sw = batch["seq_weight"].double() if batch.get("seq_weight") is not None else torch.ones(S, dtype=torch.float64)
    w = w_seq[seq] * sw[seq] * c["loss_scale"] * m
    A, old = f("advantages"), f("old_logprobs")
    C, lo, hi = c["log_ratio_clamp"], 1 - c["clip_low"], 1 + c["clip_high"]
    mean_lr = torch.zeros(S, dtype=torch.float64).index_add_(0, seq, torch.where(m, lp_occ - old, 0.0)) / n.clamp(min=1)
    if c["policy"] == "gspo":
        log_ratio = lp_occ - lp_occ.detach() + mean_lr.detach()[seq]  # verl: value the sequence mean, derivative 1
    else:
        log_ratio = lp_occ - old
    r = torch.exp(torch.clamp(log_ratio, -C, C))
    if c["policy"] == "cispo":
        L = -torch.clamp(r, lo, hi).detach() * A * lp_occ
        high, low, dual = r > hi, r < lo, torch.zeros_like(m)
    else:
        l1, l2 = -A * r, -A * torch.clamp(r, lo, hi)
        L = torch.where(l2 > l1, l2, l1)
        clipped = l2 > l1
        high, low = clipped & (A > 0), clipped & (A < 0)
        dual = (A < 0) & (c["dual_clip"] > 0) & (L > -A * c["dual_clip"])
        L = torch.where(dual, -A * c["dual_clip"], L)
    if c["tis"] == "token":
        L = L * torch.clamp(torch.exp(torch.clamp(old - f("rollout_logprobs"), -C, C)), max=c["tis_cap"])
    elif c["tis"] == "sequence":
        s = torch.zeros(S, dtype=torch.float64).index_add_(0, seq, torch.where(m, old - f("rollout_logprobs"), 0.0))
        L = L * torch.clamp(torch.exp(torch.clamp(s, -C, C)), max=c["tis_cap"])[seq]
    pg = (torch.where(m, L, 0.0) * w).sum()
    kl = torch.zeros((), dtype=torch.float64)
    if c["kl"] != "none":
        d = lp_occ - f("ref_logprobs")
        if c["kl"] == "k1":
            k = d
        elif c["kl"] == "abs":
            k = d.abs()
        elif c["kl"] == "k2":
            k = 0.5 * d * d
        else:
            x = torch.clamp(-d, -20, 20)
            k = torch.clamp(torch.exp(x) - x - 1, -10, 10)
        kl = (torch.where(m, k, 0.0) * w).sum()
    loss = pg + c["kl_coef"] * kl
    cnt = int(m.sum())
    per = lambda x: float(x[m].double().sum()) / cnt if cnt else 0.0  # noqa: E731
    ratios = r.detach()[m]
    metrics = {
        "loss": float(loss),
        "pg_loss": float(pg),
        "kl_loss": float(kl),
        "clipfrac_high": per(high),
        "clipfrac_low": per(low),
        "clipfrac_dual": per(dual),
        "approx_kl": per(old - lp_occ.detach()),
        "ratio_min": float(ratios.min()) if cnt else 0.0,
        "ratio_mean": per(r.detach()),
        "ratio_max": float(ratios.max()) if cnt else 0.0,
        "trainable_tokens": cnt,
    }
    return loss, metrics


def fixture_batch(fx):
    """The fixture's sequences, each behind a shared untrainable first token (so the forest shares a root)."""
    off, mask, fields, lp = [0], [], {k: [] for k in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")}, []
    for s in fx["sequences"]:
        L = len(s["logprobs"]) + 1
        for t in range(L):
            lp.append(0.0 if t == 0 else s["logprobs"][t - 1])
            mask.append(int(t > 0))
            fields["advantages"].append(s["advantage"])
            for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
                fields[k].append(0.0 if t == 0 else s[k][t - 1])
        off.append(off[-1] + L)
    M = len(lp)
    # Node 0 is the shared root; every other occurrence its own node.
    pos = [0 if t == 0 else 0 for t in range(M)]
    node = 1
    for i in range(len(off) - 1):
        for j in range(off[i] + 1, off[i + 1]):
            pos[j] = node
            node += 1
    batch = {"seq_offsets": torch.tensor(off), "seq_positions": torch.tensor(pos), "loss_mask": torch.tensor(mask, dtype=torch.bool)}
    batch.update({k: torch.tensor(v, dtype=torch.float32) for k, v in fields.items()})
    lp_nodes = torch.zeros(node, dtype=torch.float32)
    lp_nodes[torch.tensor(pos)] = torch.tensor(lp, dtype=torch.float32)
    return batch, lp_nodes


def fixture_configs(fx):
    p = fx["params"]
    base = {"clip_low": p["clip_low"], "clip_high": p["clip_high"], "dual_clip": p["dual_clip_c"], "log_ratio_clamp": p["log_ratio_clamp"]}
    e = fx["expected"]
    out = [({**base, "aggregation": agg, "norm_constant": 3}, want) for agg, want in e["loss"].items()]
    out.append(({**base, "kl": "k3", "kl_coef": 1.0}, e["loss"]["token-mean"] + e["k3_token_mean"]))
    out.append(
        ({"clip_low": p["clip_low"], "clip_high": p["clip_high"], "policy": "gspo", "aggregation": "seq-mean-token-mean"}, e["gspo_loss"])
    )
    out.append(({"clip_low": p["clip_low"], "clip_high": p["clip_high"], "policy": "cispo"}, e["cispo_token_mean"]))
    out.append(({**base, "tis": "token", "tis_cap": p["tis_cap"]}, e["tis_vanilla_token_mean"]))
    return out


def random_config(r):
    policy = r.choice(["ppo", "gspo", "cispo"])
    cfg = {
        "policy": policy,
        "clip_low": r.choice([0.0, 0.1, 0.2]),
        "clip_high": r.choice([0.2, 0.28, 1.0]),
        "aggregation": r.choice(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
        "norm_constant": r.choice([1.0, 7.5]),
        "kl": r.choice(["none", "k1", "abs", "k2", "k3"]),
        "kl_coef": r.choice([0.0, 0.05, 1.0]),
        "tis": r.choice(["none", "token", "sequence"]),
        "tis_cap": r.choice([0.5, 2.0]),
        "log_ratio_clamp": r.choice([0.3, 20.0]),
    }
    if policy == "ppo":
        cfg["dual_clip"] = r.choice([0.0, 3.0])
    if r.random() < 0.3:
        cfg["global_tokens"], cfg["global_sequences"] = 1000.0, 50.0
    if r.random() < 0.4:
        cfg["loss_scale"] = r.choice([0.0, 0.5, 8.0])
    return cfg


@needs_torch()
class PackedLossAgainstPlainTorch(unittest.TestCase):
    def check(self, lp_nodes, batch, cfg, want=None):
        x = lp_nodes.clone().requires_grad_(True)
        loss, metrics = tpt.packed_loss(x, batch, cfg)
        loss.backward()
        y = lp_nodes.double()[batch["seq_positions"]].clone().requires_grad_(True)
        ref, ref_metrics = plain_loss(y, batch, cfg)
        ref.backward()
        node_grad = torch.zeros_like(lp_nodes, dtype=torch.float64).index_add_(0, batch["seq_positions"], y.grad)
        tol = 1e-6 * max(1.0, abs(float(ref)))
        self.assertAlmostEqual(float(loss), float(ref), delta=tol)
        if want is not None:
            self.assertAlmostEqual(float(loss), want, delta=2e-6)
        self.assertLess(float((x.grad.double() - node_grad).abs().max()), 1e-6 * max(1.0, float(node_grad.abs().max())))
        self.assertEqual(set(metrics), set(ref_metrics))
        for k, v in ref_metrics.items():
            self.assertAlmostEqual(metrics[k], v, delta=1e-6 * max(1.0, abs(v)), msg=k)

    def test_every_fixture_config(self):
        with open(FIXTURE) as f:
            fx = json.load(f)
        batch, lp = fixture_batch(fx)
        configs = fixture_configs(fx)
        self.assertEqual(len(configs), 8)
        for cfg, want in configs:
            with self.subTest(cfg=cfg):
                self.check(lp, batch, cfg, want)

    def test_random_configs_on_packed_forests(self):
        r = random.Random(11)
        cases = 0
        for seed in range(6):
            for shape, seqs in forests(31, seed).items():
                mb = tpt.load_microbatch(pack(seqs, pad=seed % 2, seed=seed))
                batch = {
                    k: getattr(mb, k)
                    for k in ("seq_offsets", "seq_positions", "loss_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
                }
                g = torch.Generator().manual_seed(seed)
                if seed % 2:  # a trainer's per-sequence weights, zeros among them
                    batch["seq_weight"] = torch.tensor([(0.0, 1.0, 0.25, 3.0)[i % 4] for i in range(mb.num_sequences)])
                lp = -torch.rand(mb.num_nodes, generator=g) * 3
                # Non-trainable positions may hold anything, NaN included.
                lp[~torch.isin(torch.arange(mb.num_nodes), mb.seq_positions[mb.loss_mask])] = float("nan")
                for _ in range(3):
                    cfg = random_config(r)
                    with self.subTest(seed=seed, shape=shape, cfg=cfg):
                        self.check(lp, batch, cfg)
                    cases += 1
        self.assertGreater(cases, 80)

    def test_takes_the_loaded_batch(self):
        mb = tpt.load_microbatch(pack(forests(31, 2)["mixed"], seed=2))
        lp = (-torch.rand(mb.num_nodes)).requires_grad_(True)
        loss, metrics = tpt.packed_loss(lp, mb, {"kl": "k1", "kl_coef": 0.1})
        loss.backward()
        self.assertEqual(metrics["trainable_tokens"], int(mb.loss_mask.sum()))
        self.assertTrue(torch.isfinite(lp.grad).all())
        loss2, metrics_t = tpt.PackedLoss.apply(lp, mb, {"kl": "k1", "kl_coef": 0.1})
        self.assertEqual(float(loss2), float(loss))
        self.assertEqual(metrics_t.tolist()[0], metrics["loss"])
        # The torch loss lives in treepack.torch only: treepack.loss (numpy, no torch) no longer reaches into it.
        import treepack.loss

        self.assertFalse(hasattr(treepack.loss, "PackedLoss"))


def flow_grpo(trajectories, lp_nodes, cfg):
    """AgentFlow's Flow-GRPO on UNMERGED trajectories, in float64 torch autograd: (1/G) sum_i w_i (1/T_i) sum_t
    (1/|a_t|) sum_j l_j, times loss_scale, with l_j verl's clipped surrogate plus kl_coef times k2. A trajectory is
    (weight, turns); a turn is its own list of tokens (node, mask, old, ref, advantage). Returns the loss; lp_nodes is
    the leaf whose gradient is compared."""
    c = LossConfig(**cfg)
    live = [t for t in trajectories if any(tok[1] for turn in t[1] for tok in turn)]
    G = c.global_sequences or len(live)
    total = torch.zeros((), dtype=torch.float64)
    for weight, turns in live:
        counted = [turn for turn in turns if any(tok[1] for tok in turn)]
        for turn in counted:
            toks = [tok for tok in turn if tok[1]]
            for node, _, old, ref, A in toks:
                x = lp_nodes[node]
                r = torch.exp(torch.clamp(x - old, -c.log_ratio_clamp, c.log_ratio_clamp))
                L = torch.maximum(-A * r, -A * torch.clamp(r, 1 - c.clip_low, 1 + c.clip_high))
                if A < 0 and c.dual_clip > 0:
                    L = torch.minimum(L, torch.tensor(-A * c.dual_clip, dtype=torch.float64))
                total = total + c.loss_scale * weight / (G * len(counted) * len(toks)) * (L + c.kl_coef * 0.5 * (x - ref) ** 2)
    return total


@needs_torch()
class FlowGrpoAgainstUnmergedTurns(unittest.TestCase):
    """Each trajectory merged into one sequence (prompt, turn, tool output, turn, ...), packed with pack_sequences'
    turns (so the forest shares common prefixes and turn_ids come from the packer), against flow_grpo on the turns."""

    def case(self, seed, count, share=False):
        r = random.Random(seed)
        seqs, starts, trajectories, first = [], [], [], []
        for i in range(count):
            tokens, turn_starts, turns = [1, 2, 3 + i % 2], [], []
            for k in range(1 + r.randrange(4)):
                if k:
                    tokens += [20 + r.randrange(4) for _ in range(1 + r.randrange(3))]  # a tool message
                ids = first[i - 2] if share and k == 0 and i >= 2 else [10 + r.randrange(6) for _ in range(1 + r.randrange(5))]
                if k == 0:
                    first.append(ids)
                turn_starts.append(len(tokens))
                turns.append((len(tokens), len(ids)))
                tokens += ids
            seqs.append(tokens)
            starts.append(turn_starts)
            trajectories.append(turns)
        mb = pack_sequences(seqs, turns=starts)
        M, N = len(mb.seq_positions), len(mb.input_ids)
        mask = torch.zeros(M, dtype=torch.bool)
        old, ref, adv = (torch.tensor([r.uniform(-3, 0) for _ in range(M)]) for _ in range(3))
        adv = torch.tensor([r.choice([-1.5, 0.0, 0.75, 2.0]) for _ in range(M)])
        unmerged = []
        for i, turns in enumerate(trajectories):
            off = int(mb.seq_offsets[i])
            as_lists = []
            for start, n in turns:
                hole = r.random() < 0.15  # a turn with nothing to train
                turn = []
                for t in range(start, start + n):
                    j = off + t
                    mask[j] = not hole and r.random() < 0.8
                    turn.append((int(mb.seq_positions[j]), bool(mask[j]), float(old[j]), float(ref[j]), float(adv[j])))
                as_lists.append(turn)
            unmerged.append(((0.0, 1.0, 0.5, 2.0)[i % 4], as_lists))
        batch = {
            "seq_offsets": torch.from_numpy(mb.seq_offsets),
            "seq_positions": torch.from_numpy(mb.seq_positions),
            "loss_mask": mask,
            "advantages": adv,
            "old_logprobs": old,
            "ref_logprobs": ref,
            "turn_ids": torch.from_numpy(mb.turn_ids),
            "seq_weight": torch.tensor([w for w, _ in unmerged]),
        }
        lp = -torch.rand(N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
        return batch, lp.float(), unmerged

    def check(self, batch, lp, unmerged, cfg, device="cpu"):
        x = lp.detach().clone().to(device).requires_grad_(True)
        loss, metrics = tpt.packed_loss(x, {k: v.to(device) for k, v in batch.items()}, cfg)
        loss.backward()
        y = lp.detach().double().requires_grad_(True)
        want = flow_grpo(unmerged, y, cfg)
        want.backward()
        self.assertAlmostEqual(float(loss), float(want.detach()), delta=1e-6 * max(1.0, abs(float(want.detach()))))
        self.assertLess(float((x.grad.cpu().double() - y.grad).abs().max()), 1e-6 * max(1.0, float(y.grad.abs().max())))
        self.assertEqual(metrics["trainable_tokens"], int(batch["loss_mask"].sum()))

    def test_many_turns_shared_turns_weights_and_scale(self):
        cases = 0
        for seed in range(8):
            batch, lp, unmerged = self.case(seed, 3 + seed, share=seed % 2 == 1)
            for cfg in ({}, {"loss_scale": 4.0, "dual_clip": 3.0}, {"global_sequences": 30.0, "kl": "k2", "kl_coef": 0.3}):
                with self.subTest(seed=seed, cfg=cfg):
                    self.check(
                        batch, lp, unmerged, {"aggregation": "seq-mean-turn-mean-token-mean", "clip_low": 0.2, "clip_high": 0.28, **cfg}
                    )
                cases += 1
        self.assertEqual(cases, 24)

    def test_typed_config_and_negative_control(self):
        batch, lp, unmerged = self.case(3, 8)
        cfg = LossConfig(aggregation="seq-mean-turn-mean-token-mean", loss_scale=2.0)
        loss, _ = tpt.packed_loss(lp, batch, cfg)
        self.assertAlmostEqual(float(loss), float(flow_grpo(unmerged, lp.double(), cfg.to_dict())), delta=1e-6)
        other, _ = tpt.packed_loss(lp, batch, {"aggregation": "seq-mean-token-mean", "loss_scale": 2.0})
        self.assertGreater(abs(float(other) - float(loss)), 1e-4)  # the turn mean is not the sequence's token mean

    def test_refusals_name_the_field(self):
        batch, lp, _ = self.case(5, 4)
        turns = {"aggregation": "seq-mean-turn-mean-token-mean"}
        for bad, field in (
            ({k: v for k, v in batch.items() if k != "turn_ids"}, "turn_ids"),
            ({**batch, "turn_ids": batch["turn_ids"].flip(0)}, "turn_ids"),
            ({**batch, "seq_weight": -batch["seq_weight"] - 1}, "seq_weight"),
            ({**batch, "seq_weight": batch["seq_weight"][:-1]}, "seq_weight"),
        ):
            with self.subTest(field=field), self.assertRaises(TreepackError) as cm:
                tpt.packed_loss(lp, bad, turns)
            self.assertEqual(cm.exception.field, field, str(cm.exception))

    @needs_torch(cuda="needs a CUDA device")
    def test_cuda_equals_the_formula(self):
        for seed in range(3):
            batch, lp, unmerged = self.case(seed, 6, share=True)
            self.check(
                batch, lp, unmerged, {"aggregation": "seq-mean-turn-mean-token-mean", "loss_scale": 3.0, "kl": "k2", "kl_coef": 0.1}, "cuda"
            )


@needs_torch()
class PackedLossErrors(unittest.TestCase):
    def setUp(self):
        self.mb = tpt.load_microbatch(pack(forests(31, 4)["mixed"], seed=4))
        self.lp = -torch.rand(self.mb.num_nodes)

    def assertField(self, field, fn):
        with self.assertRaises(TreepackError) as cm:
            fn()
        self.assertEqual(cm.exception.field, field, str(cm.exception))

    def test_config_errors_name_the_field(self):
        for cfg, field in (
            ({"policy": "gspo", "dual_clip": 3.0}, "dual_clip"),
            ({"log_ratio_clamp": 0}, "log_ratio_clamp"),
            ({"tis_cap": 0}, "tis_cap"),
            ({"clip_low": -0.1}, "clip_low"),
            ({"clip_lo": 0.1}, "clip_lo"),
            ({"kl": "k4"}, "kl"),
            ({"dual_clip": 1.0}, "dual_clip"),
            ({"kl_coef": float("nan")}, "kl_coef"),
            ({"clip_high": True}, "clip_high"),
            ({"aggregation": "seq-mean-token-sum-norm"}, "norm_constant"),
        ):
            with self.subTest(cfg=cfg):
                self.assertField(field, functools.partial(tpt.packed_loss, self.lp, self.mb, cfg))

    def test_input_errors_name_the_field(self):
        mb = self.mb

        def as_dict(**kw):
            return {**{k: getattr(mb, k) for k in ("seq_offsets", "seq_positions", "loss_mask", "advantages", "old_logprobs")}, **kw}

        self.assertField("logprobs", lambda: tpt.packed_loss(self.lp[:-1], mb))
        self.assertField("logprobs", lambda: tpt.packed_loss(self.lp.long(), mb))
        bad = self.lp.clone()
        bad[mb.seq_positions[mb.loss_mask][0]] = float("inf")
        self.assertField("logprobs", lambda: tpt.packed_loss(bad, mb))
        self.assertField("seq_positions", lambda: tpt.packed_loss(self.lp, as_dict(seq_positions=mb.seq_positions.float())))
        self.assertField("seq_positions", lambda: tpt.packed_loss(self.lp, as_dict(seq_positions=mb.seq_positions + mb.num_nodes)))
        self.assertField("loss_mask", lambda: tpt.packed_loss(self.lp, as_dict(loss_mask=mb.loss_mask[:-1])))
        self.assertField("seq_offsets", lambda: tpt.packed_loss(self.lp, as_dict(seq_offsets=mb.seq_offsets.flip(0))))
        self.assertField("ref_logprobs", lambda: tpt.packed_loss(self.lp, as_dict(), {"kl": "k3", "kl_coef": 0.1}))
        self.assertField("advantages", lambda: tpt.packed_loss(self.lp, as_dict(advantages=mb.advantages.int())))
        meta_device = torch.device("meta")
        self.assertField("seq_offsets", lambda: tpt.packed_loss(self.lp, as_dict(seq_offsets=mb.seq_offsets.to(meta_device))))


@needs_torch(cuda="needs a CUDA device")
class PackedLossCuda(unittest.TestCase):
    def test_cuda_equals_cpu_on_a_second_device_and_its_stream(self):
        mb = tpt.load_microbatch(pack(forests(31, 6)["mixed"], seed=6))
        cfg = {"clip_low": 0.2, "clip_high": 0.28, "kl": "k3", "kl_coef": 0.1, "tis": "token"}
        lp = -torch.rand(mb.num_nodes)
        x = lp.clone().requires_grad_(True)
        loss_cpu, m_cpu = tpt.packed_loss(x, mb, cfg)
        loss_cpu.backward()
        dev = torch.device("cuda", torch.cuda.device_count() - 1)
        y = lp.to(dev).requires_grad_(True)
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            loss_gpu, m_gpu = tpt.packed_loss(y, mb.to(dev), cfg)
            loss_gpu.backward()
        torch.cuda.synchronize(dev)
        self.assertEqual(loss_gpu.device, dev)
        self.assertAlmostEqual(float(loss_gpu), float(loss_cpu), delta=1e-6)
        self.assertLess(float((y.grad.cpu() - x.grad).abs().max()), 1e-6)
        for k in m_cpu:
            self.assertAlmostEqual(m_gpu[k], m_cpu[k], delta=1e-5 * max(1.0, abs(m_cpu[k])), msg=k)
        self.assertRaises(TreepackError, lambda: tpt.packed_loss(y, mb, cfg))  # batch on the CPU, lp on CUDA


if __name__ == "__main__":
    unittest.main()
