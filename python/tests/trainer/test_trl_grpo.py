"""treepack.integrations.trl against TRL itself: the packed GRPOTrainer's per-token logprobs, entropies, logged
loss and metrics and every parameter gradient of a real ``train()`` step equal the stock trainer's (unpacked
forwards of the same Hugging Face model code), and packing happened (N distinct prefixes < M tokens).

Offline: a WordLevel tokenizer, tiny random Qwen3 / Llama models saved to a temporary directory, a seeded
``rollout_func`` with shared stems, a duplicate completion, a completion that is a prefix of another, an EOS-only
completion, a multi-turn row whose tool tokens are masked (``env_mask``) and a truncated row. Gradients are taken
before the optimizer step (``on_pre_optimizer_step``), not from weights after Adam.

Cases: every loss type × β ∈ {0, 0.04} on Qwen3 in float64 (TRL's train step), LoRA with four of them, two on Llama
(one with LoRA), per-token checks in float32 and float64, one float32 step. Runtime on a shared 2-core CPU
(OMP_NUM_THREADS=1): this file and test_trl_packed.py together about 70 s, 20 s of it imports.
"""

from __future__ import annotations

import importlib.util
import os
import random
import tempfile
import unittest
from typing import Any

from support import CORE_SKIP, TORCH_SKIP, needs_torch, patch_norms_to_input_dtype, tiny_model, torch

if not TORCH_SKIP:
    import treepack.torch as tpt
    from treepack.torch import unwrap

TRL_SKIP = (
    ""
    if all(importlib.util.find_spec(m) for m in ("trl", "peft", "datasets", "accelerate"))
    else "trl, peft, datasets or accelerate not importable (pip install -r python/requirements-integrations.txt)"
)
if TRL_SKIP and not (CORE_SKIP or TORCH_SKIP) and os.environ.get("TREEPACK_REQUIRE_TORCH") == "1":
    raise RuntimeError(f"TREEPACK_REQUIRE_TORCH=1 but {TRL_SKIP}")

VOCAB = 64
PAD, EOS = 0, 1
G = 4  # completions per prompt
SYSTEM = [2, 3, 4, 5]  # every prompt's stem: shared across groups


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")


def rollouts(prompts: list[str], seed: int, max_len: int) -> dict[str, Any]:
    """Rows of groups of G, seeded (random.Random, never hash()): group 0 holds a duplicate, an EOS-only
    completion and a multi-turn row (tool tokens masked) that continues another completion; group 1 a truncated
    row (max_len tokens, no EOS) that is a prefix of another; the rest random with shared stems."""
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for at in range(0, len(prompts), G):
        k = int(prompts[at][1:])
        r = random.Random(seed * 1000 + k)
        tok = lambda n, r=r: [r.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
        prompt = SYSTEM + tok(r.randrange(1, 4))
        stem = tok(2)
        if k % 4 == 0:
            a = stem + tok(2) + [EOS]
            rows = [(a, [1] * len(a)), (a, [1] * len(a)), ([EOS], [1]), (a + tok(2) + [7, EOS], [1] * len(a) + [0, 0] + [1, 1])]
        elif k % 4 == 1:
            t = stem + tok(max_len - 2)
            rows = [(t, [1] * max_len), (t[:5] + [EOS], [1] * 6), (stem + tok(1) + [EOS], [1] * 4), (tok(3) + [EOS], [1] * 4)]
        else:
            rows = []
            for _ in range(G):
                c = (stem if r.random() < 0.7 else tok(2)) + tok(r.randrange(0, 4)) + [EOS]
                rows.append((c, [1] * len(c)))
        for c, m in rows:
            out["prompt_ids"].append(list(prompt))
            out["completion_ids"].append(c)
            out["logprobs"].append([-r.random() * 3 for _ in c])
            out["env_mask"].append(m)
    return out


def reward(completion_ids, **kwargs):
    return [float(sum(c) % 7) / 7 for c in completion_ids]


def patch_rope_to_float64(model) -> None:
    """HF computes RoPE angles in float32 whatever the model's dtype, so shifting a row's positions (TRL's left
    padding; packed positions start at 0) moves them by ~1e-7: float64 tests compute them in float64."""
    import types

    def forward(self, x, position_ids):
        inv = self.inv_freq.double()[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].double()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            m.forward = types.MethodType(forward, m)


def tiny_moe():
    """A 2-layer random-weight Qwen3-MoE (4 experts, 2 per token) in float32, its routers' weights far from ties."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.data.normal_(0.0, 1.0)
    return model


def router_in_input_dtype(self, hidden_states):
    """Qwen3MoeTopKRouter.forward with its softmax in the logits' dtype (transformers': float32 always)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)
    top, idx = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), idx


def aux_float64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (the Qwen3-MoE one) accumulated in float64 instead of float32."""
    f64 = torch.float64
    count, prob, rows = torch.zeros(num_experts, dtype=f64), torch.zeros(num_experts, dtype=f64), 0.0
    mask = attention_mask.reshape(-1).to(f64)
    for layer in gate_logits:
        p = torch.softmax(layer.to(f64), dim=-1)
        _, chosen = torch.topk(p, top_k, dim=-1)
        count = count + torch.zeros(num_experts, dtype=f64).scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob = prob + (p * mask[:, None]).sum(0)
        rows = rows + mask.sum()
    return torch.sum((count / rows) * (prob / rows)) * num_experts


def GRPOTrainer_forward(t, ids, att, C):
    """TRL's own aux loss for the rows (stock _get_per_token_logps_and_entropies on the unwrapped model)."""
    from trl import GRPOTrainer

    return GRPOTrainer._get_per_token_logps_and_entropies(t, t.model, ids, att, C, compute_aux_loss=True)[2]


class Capture:
    """Per-parameter gradients before the optimizer step, and the logs."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Capture(TrainerCallback):
            def __init__(self):
                self.grads: dict[str, torch.Tensor] = {}
                self.logs: list[dict[str, float]] = []

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

            def on_log(self, args, state, control, logs=None, **kwargs):
                self.logs.append(dict(logs))

        return _Capture()


@needs_torch(transformers=True)
@unittest.skipIf(bool(TRL_SKIP), TRL_SKIP)
class TRLGRPOTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.tok = tokenizer()
        cls.paths = {}
        for family in ("qwen3", "llama"):
            path = os.path.join(cls.tmp.name, family)
            tiny_model(family, torch.float32, attn="sdpa", vocab=VOCAB).save_pretrained(path)
            cls.paths[family] = path
        cls.paths["qwen3_moe"] = os.path.join(cls.tmp.name, "qwen3_moe")
        tiny_moe().save_pretrained(cls.paths["qwen3_moe"])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def trainer(
        self,
        packed: bool,
        family: str = "qwen3",
        dtype=torch.float64,
        lora: bool = False,
        forward_only: bool = False,
        rollout: bool = True,
        **cfg,
    ):
        """A stock GRPOTrainer (group-whole split, stock forwards) or TreepackGRPOTrainer from the same saved weights
        and seed; ``forward_only``: packed forwards with TRL's own shuffled split."""
        from datasets import Dataset
        from peft import LoraConfig
        from treepack.integrations.trl import GroupedBatchesMixin, PackedForwardMixin, TreepackGRPOTrainer
        from trl import GRPOConfig, GRPOTrainer

        attn = "treepack" if packed else "sdpa"
        init = {"attn_implementation": attn, "dtype": dtype, **({"experts_implementation": "eager"} if family == "qwen3_moe" else {})}
        args = dict(
            output_dir=self.tmp.name,
            per_device_train_batch_size=2 * G,
            gradient_accumulation_steps=2,
            steps_per_generation=2,
            num_generations=G,
            max_completion_length=8,
            num_iterations=2,
            max_steps=1,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
            use_cpu=True,
            mask_truncated_completions=True,
            top_entropy_quantile=0.5,
            beta=0.0,
            loss_type="dapo",
            model_init_kwargs=init,
            temperature=0.7,
            disable_tqdm=True,
        )
        args.update(cfg)
        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False) if lora else None
        if forward_only:
            cls = type("PackedForwardGRPOTrainer", (PackedForwardMixin, GRPOTrainer), {})
        elif packed:
            cls = TreepackGRPOTrainer
        else:  # splits as the packed trainer does (whole groups), so grpo / bnpo / dr_grpo normalise alike
            cls = type("GroupedGRPOTrainer", (GroupedBatchesMixin, GRPOTrainer), {})
        capture = Capture()
        torch.manual_seed(0)  # the LoRA initialisation
        t = cls(
            model=self.paths[family],
            reward_funcs=reward,
            args=GRPOConfig(**args),
            train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(4)]}),
            processing_class=self.tok,
            peft_config=peft,
            callbacks=[capture],
            rollout_func=(lambda prompts, trainer: rollouts(prompts, 0, 8)) if rollout else None,
        )
        if dtype == torch.float64:  # HF computes RMSNorm and RoPE angles in float32 whatever the dtype
            for m in (t.model, t.ref_model):
                if m is not None:
                    patch_norms_to_input_dtype(m)
                    patch_rope_to_float64(m)
        return t, capture

    def trained(self, packed: bool, **kw):
        """A trainer after its step, built right before it: the global RNG (sampling) starts from the seed."""
        t, cap = self.trainer(packed, **kw)
        t.train()
        return t, cap

    def assertClose(self, a: torch.Tensor, b: torch.Tensor, tol: float, what: str):
        err = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        self.assertLessEqual(err, tol * max(1.0, float(b.double().abs().max())), f"{what}: max difference {err:.3g}")

    def assertLogsEqual(self, stock: dict[str, float], packed: dict[str, float], tol: float, only: Any = None):
        keys = [k for k in stock if "time" not in k and "per_second" not in k and (only is None or k in only)]
        self.assertIn("loss", stock)
        for k in keys:
            self.assertAlmostEqual(packed[k], stock[k], delta=tol * max(1.0, abs(stock[k])), msg=f"logged {k}")

    def step(self, family="qwen3", lora=False, **cfg):
        """One train() step in float64, stock and packed: logged loss and metrics and every gradient equal."""
        (stock, s_cap), (packed, p_cap) = self.trainer(False, family, lora=lora, **cfg), self.trainer(True, family, lora=lora, **cfg)
        stock.train()
        packed.train()
        self.assertLogsEqual(s_cap.logs[0], p_cap.logs[0], 1e-10)
        self.assertTrue(s_cap.grads)
        self.assertEqual(sorted(s_cap.grads), sorted(p_cap.grads))
        for n, g in s_cap.grads.items():
            self.assertClose(p_cap.grads[n], g, 1e-10, f"gradient of {n}")
        self.assertTrue(packed.treepack_stats)
        for naive, nodes in packed.treepack_stats:  # every forward packed
            self.assertLess(nodes, naive)

    def test_moe_aux_loss(self):
        """A Qwen3-MoE with TRL's router load-balancing loss on (a large coefficient, so it weighs): the packed step's
        logged loss and aux_loss and every gradient equal stock TRL's, whose aux_loss counts each row's tokens. In
        float64 the router's softmax and transformers' aux loss, float32 whatever the dtype, run in float64 on both
        sides (as the norms and RoPE do here)."""
        from unittest import mock

        import transformers.models.qwen3_moe.modeling_qwen3_moe as qm

        with (
            mock.patch.object(qm.Qwen3MoeTopKRouter, "forward", router_in_input_dtype),
            mock.patch.object(qm, "load_balancing_loss_func", aux_float64),
        ):
            for loss, beta in (("dapo", 0.04), ("grpo", 0.0)):
                with self.subTest(loss=loss, beta=beta):
                    (stock, s_cap), (packed, p_cap) = (
                        self.trained(p, family="qwen3_moe", loss_type=loss, beta=beta, router_aux_loss_coef=0.5) for p in (False, True)
                    )
                    self.assertIn("aux_loss", s_cap.logs[0])
                    self.assertLogsEqual(s_cap.logs[0], p_cap.logs[0], 1e-10)
                    for n, g in s_cap.grads.items():
                        self.assertClose(p_cap.grads[n], g, 1e-10, f"gradient of {n}")
                    self.assertTrue(any("mlp.gate" in n for n in p_cap.grads))
        # Negative control: each packed node counted once (the tokens the forward saw) gives another aux loss.
        t, _ = self.trainer(True, family="qwen3_moe", router_aux_loss_coef=0.5)
        ids, att, C = self.rows()
        with (
            torch.no_grad(),
            mock.patch("treepack.integrations.trl.load_balancing_loss", lambda router, batch: tpt.load_balancing_loss(router)),
        ):
            once = t._get_per_token_logps_and_entropies(t.model, ids, att, C, compute_aux_loss=True)[2]
        with torch.no_grad():
            right = t._get_per_token_logps_and_entropies(t.model, ids, att, C, compute_aux_loss=True)[2]
            unwrap(t.model).set_attn_implementation("sdpa")
            stock = GRPOTrainer_forward(t, ids, att, C)
        self.assertLessEqual(abs(float(right - stock)), 1e-6 * float(stock))
        self.assertGreater(abs(float(once - stock)), 1e-4 * float(stock))

    def test_loss_types(self):
        for loss in ("dapo", "grpo", "dr_grpo", "bnpo", "cispo"):
            for beta in (0.0, 0.04):
                with self.subTest(loss=loss, beta=beta):
                    self.step(loss_type=loss, beta=beta)

    def test_lora(self):
        for loss, beta in (("dapo", 0.04), ("grpo", 0.0), ("bnpo", 0.04), ("cispo", 0.04)):
            with self.subTest(loss=loss, beta=beta):
                self.step(lora=True, loss_type=loss, beta=beta)

    def test_llama(self):
        for loss, beta, lora in (("dapo", 0.04, False), ("dr_grpo", 0.04, True)):
            with self.subTest(loss=loss, beta=beta, lora=lora):
                self.step(family="llama", lora=lora, loss_type=loss, beta=beta)

    def test_trl_generation(self):
        """TRL's own sampling (transformers generate, no rollout_func) in the packed trainer: the same completions
        as the stock trainer's from the same seed, and the same step."""
        (stock, s_cap), (packed, p_cap) = (self.trained(p, rollout=False, loss_type="dapo", beta=0.04) for p in (False, True))
        self.assertLogsEqual(s_cap.logs[0], p_cap.logs[0], 1e-10)
        for n, g in s_cap.grads.items():
            self.assertClose(p_cap.grads[n], g, 1e-10, f"gradient of {n}")
        self.assertEqual(unwrap(packed.model).config._attn_implementation, "treepack")

    def test_budget_refused(self):
        """A group that alone packs to more than treepack_max_tokens stops training with a TreepackError naming
        max_tokens, rather than running an over-budget micro-batch."""
        from treepack import TreepackError

        t, _ = self.trainer(True)
        t.treepack_max_tokens = 8
        with self.assertRaises(TreepackError) as e:
            t.train()
        self.assertEqual(e.exception.field, "max_tokens")

    def rows(self):
        """Padded rows of one generation batch as TRL builds them (left-padded prompts, right-padded completions)."""
        out = rollouts([f"p{i}" for i in range(4) for _ in range(G)], 0, 8)
        P = max(map(len, out["prompt_ids"]))
        C = max(map(len, out["completion_ids"]))
        ids, att = [], []
        for p, c in zip(out["prompt_ids"], out["completion_ids"]):
            ids.append([PAD] * (P - len(p)) + p + c + [PAD] * (C - len(c)))
            att.append([0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c)))
        return torch.tensor(ids), torch.tensor(att), C

    def test_per_token(self):
        """The override's logprobs and entropies equal TRL's own method on the same rows, 0 where unattended;
        its forest has exactly the rows' distinct prefixes as nodes."""
        from trl import GRPOTrainer

        ids, att, C = self.rows()
        sequences = [r[m.bool()].tolist() for r, m in zip(ids, att)]
        prefixes = {tuple(s[: t + 1]) for s in sequences for t in range(len(s))}
        self.assertLess(len(prefixes), sum(map(len, sequences)))
        for family, dtype, lora in (
            ("qwen3", torch.float32, False),
            ("qwen3", torch.float64, False),
            ("qwen3", torch.float32, True),
            ("llama", torch.float64, True),
        ):
            with self.subTest(family=family, dtype=dtype, lora=lora):
                tol = 1e-10 if dtype == torch.float64 else 1e-5
                t, _ = self.trainer(True, family, dtype, lora)
                with torch.no_grad():
                    lp, ent, _ = t._get_per_token_logps_and_entropies(t.model, ids, att, C, compute_entropy=True)
                    self.assertEqual(t.treepack_stats[-1], (int(att.sum()), len(prefixes)))
                    base = unwrap(t.model)
                    base.set_attn_implementation("sdpa")
                    ref_lp, ref_ent, _ = GRPOTrainer._get_per_token_logps_and_entropies(t, t.model, ids, att, C, compute_entropy=True)
                    base.set_attn_implementation("treepack")
                mask = att[:, -C:].bool()
                self.assertClose(lp[mask], ref_lp[mask], tol, "logprobs")
                self.assertClose(ent[mask], ref_ent[mask], tol, "entropies")
                self.assertTrue(bool((lp[~mask] == 0).all() and (ent[~mask] == 0).all()), "fill 0 where unattended")
        # Negative control: the comparison sees a sampling temperature not applied as TRL applies it.
        t.temperature = 1.0
        with torch.no_grad():
            wrong = t._get_per_token_logps_and_entropies(t.model, ids, att, C)[0]
        self.assertGreater(float((wrong[mask] - ref_lp[mask]).abs().max()), 1e-3)

    def test_float32_step(self):
        """float32: the packed step's gradients are as close to float64's as the stock step's own (float32 sums
        over tokens in another order), and the loss equal to 1e-5."""
        runs = {}
        for name, packed, dtype in (
            ("stock64", False, torch.float64),
            ("stock32", False, torch.float32),
            ("packed32", True, torch.float32),
        ):
            t, cap = self.trainer(packed, dtype=dtype, loss_type="dapo", beta=0.04)
            t.train()
            runs[name] = cap
        s_logs, p_logs = runs["stock32"].logs[0], runs["packed32"].logs[0]
        self.assertLogsEqual(s_logs, p_logs, 1e-5, only=[k for k in s_logs if k != "grad_norm"])
        for n, g64 in runs["stock64"].grads.items():
            stock_err = float((runs["stock32"].grads[n].double() - g64).abs().max())
            packed_err = float((runs["packed32"].grads[n].double() - g64).abs().max())
            self.assertLessEqual(
                packed_err, 2 * stock_err + 1e-6, f"gradient of {n}: packed float32 {packed_err:.3g} off float64, stock {stock_err:.3g}"
            )

    def test_group_whole_split(self):
        """Against TRL's shuffled split (stock _prepare_inputs, packed forwards): fewer packed tokens in all, and the
        same dapo loss and gradients (dapo divides by the generation batch's tokens, not the micro-batch's; the
        top-entropy quantile and the logged means are per micro-batch, so they are off here)."""
        (shuffled, s_cap), (grouped, g_cap) = (self.trainer(True, forward_only=f, top_entropy_quantile=1.0) for f in (True, False))
        shuffled.train()
        grouped.train()
        self.assertLogsEqual(s_cap.logs[0], g_cap.logs[0], 1e-10, only=["grad_norm", "reward"])
        # The Trainer sums the micro-batches' losses into a float32 tensor (_tr_loss) in the order they run, and the
        # two splits run them in different orders: the logged loss agrees to float32's rounding of that sum.
        self.assertAlmostEqual(g_cap.logs[0]["loss"], s_cap.logs[0]["loss"], delta=2**-22 * abs(s_cap.logs[0]["loss"]))
        for n, g in s_cap.grads.items():
            self.assertClose(g_cap.grads[n], g, 1e-10, f"gradient of {n}")
        # First the old-logprob forward of the generation batch, in chunks of whole groups (the same in both), then
        # the loss forwards of the micro-batches.
        self.assertEqual(shuffled.treepack_stats[:2], grouped.treepack_stats[:2])
        self.assertLess(sum(n for _, n in grouped.treepack_stats[2:]), sum(n for _, n in shuffled.treepack_stats[2:]))


if __name__ == "__main__":
    unittest.main()
