"""Hybrid models on prefix trees: tiny random-weight Qwen3.5 (text), Qwen3-Next, Nemotron-H (Mamba2) and Kimi Linear
(KDA) from transformers, run packed (treepack.torch.prepare: tree execution of their recurrent layers) and unpacked
(each sequence alone through the stock model), on a forest built to stress the segments: branch points at 63/64/65
and 127/128/129 tokens (the 64-token chunk grid), segments of 1 and 2 tokens (shorter than the conv kernel), a root
with many children, depth >= 30, duplicate sequences, a sequence that is a prefix of another, pad nodes.

float64: per-token logprobs, entropies, the loss, the input-embedding gradient and every parameter gradient within
1e-10, with and without chunk alignment. transformers computes these layers partly in float32 whatever the model's
dtype, and the packed run rounds differently where a segment starts off the unpacked run's chunk grid, so the
float64 models come from their modeling files with every float32 cast turned to float64 (``float64_modeling``). The
stock float32 code is measured too: with chunk alignment the Gated DeltaNet layer gives the unpacked outputs bit for
bit; without, its outputs differ at float32 rounding (bounded below). A negative control runs the same model on the
packed row without tree execution and must differ."""

import copy
import functools
import importlib
import inspect
import random
import re
import sys
import types
import unittest

from support import needs_torch, pack, torch, tpt
from test_exactness import objective, unpacked_logprobs
from treepack import TreepackError

VOCAB = 61


def float64_modeling(name: str) -> types.ModuleType:
    """transformers.models.<name>.modeling_<name> executed again with every float32 cast (``torch.float32``,
    ``torch.float``, ``.float()``) a float64 one (and the modeling modules it imports classes from, e.g. Nemotron-H's
    Zamba2 gated norm), as a separate module."""
    full = f"transformers.models.{name}.modeling_{name}"
    key = full + "_float64"
    if key in sys.modules:
        return sys.modules[key]
    stock = importlib.import_module(full)
    code = re.sub(r"\btorch\.float(32)?\b", "torch.float64", inspect.getsource(stock)).replace(".float()", ".double()")
    for other in sorted(set(re.findall(r"from \.\.\.models\.(\w+)\.modeling_\w+ import", code))):
        float64_modeling(other)
        code = code.replace(
            f"from ...models.{other}.modeling_{other} import", f"from transformers.models.{other}.modeling_{other}_float64 import"
        )
    mod = types.ModuleType(key)
    mod.__package__ = f"transformers.models.{name}"
    mod.__file__ = stock.__file__
    sys.modules[key] = mod
    exec(compile(code, stock.__file__, "exec"), mod.__dict__)
    return mod


def _configs():
    import transformers

    lin = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    att = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    two = ["linear_attention", "full_attention"]
    return {
        "qwen3_5": ("Qwen3_5ForCausalLM", transformers.Qwen3_5TextConfig(num_hidden_layers=2, layer_types=two, **lin, **att)),
        "qwen3_next": (
            "Qwen3NextForCausalLM",
            transformers.Qwen3NextConfig(num_hidden_layers=2, layer_types=two, mlp_only_layers=[0, 1], **lin, **att),
        ),
        "nemotron_h": (
            "NemotronHForCausalLM",
            transformers.NemotronHConfig(
                layers_block_type=["mamba", "attention", "mamba", "mlp"],
                mamba_num_heads=4,
                mamba_head_dim=8,
                ssm_state_size=8,
                n_groups=2,
                conv_kernel=4,
                chunk_size=64,
                **att,
            ),
        ),
        "kimi_linear": (
            "KimiLinearForCausalLM",
            transformers.KimiLinearConfig(
                vocab_size=VOCAB,
                pad_token_id=0,
                bos_token_id=None,
                eos_token_id=None,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                kv_lora_rank=8,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                v_head_dim=8,
                qk_nope_head_dim=8,
                mlp_layer_types=["dense", "dense"],
                max_position_embeddings=512,
                linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "full_attn_layers": [2], "kda_layers": [1]},
            ),
        ),
    }


FAMILIES = ("qwen3_5", "qwen3_next", "nemotron_h", "kimi_linear")


def _sharing_configs():
    """Families whose recurrent layers call the same functions as the ones above (forward-checked)."""
    import transformers

    att = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512
    )
    mamba = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=64)
    return {
        "bamba": ("BambaForCausalLM", transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], **mamba, **att)),
        "granitemoehybrid": (
            "GraniteMoeHybridForCausalLM",
            transformers.GraniteMoeHybridConfig(
                num_hidden_layers=2,
                layer_types=["mamba", "attention"],
                num_local_experts=2,
                num_experts_per_tok=1,
                shared_intermediate_size=16,
                **mamba,
                **att,
            ),
        ),
        "falcon_h1": ("FalconH1ForCausalLM", transformers.FalconH1Config(num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, **mamba, **att)),
        "zamba2": (
            "Zamba2ForCausalLM",
            transformers.Zamba2Config(
                num_hidden_layers=3,
                layers_block_type=["mamba", "hybrid", "mamba"],
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_ngroups=2,
                mamba_headdim=8,
                n_mamba_heads=8,
                chunk_size=64,
                attention_head_dim=16,
                num_mem_blocks=1,
                **dict(att, num_key_value_heads=2),
            ),
        ),
        "olmo_hybrid": (
            "OlmoHybridForCausalLM",
            transformers.OlmoHybridConfig(
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
                pad_token_id=0,
                eos_token_id=None,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                **att,
            ),
        ),
        "qwen3_5_moe": (
            "Qwen3_5MoeForCausalLM",
            transformers.Qwen3_5MoeTextConfig(
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
                head_dim=16,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                **att,
            ),
        ),
    }


def hybrid_model(family: str, float64: bool = True, attn: str = "treepack", seed: int = 0, vocab: int = VOCAB):
    """A tiny random-weight model of the family's real transformers class (eval mode), float64 with float64 casts
    or the stock float32 code; ``family`` one of ``FAMILIES`` or of the families sharing their layers."""
    cls_name, cfg = {**_configs(), **_sharing_configs()}[family]
    cfg = copy.deepcopy(cfg)
    cfg.vocab_size = vocab
    cfg._experts_implementation = "eager"  # grouped_mm has no float64
    mod = float64_modeling(family) if float64 else importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(seed)
    model = getattr(mod, cls_name)(cfg).to(torch.float64 if float64 else torch.float32).eval()
    model.set_attn_implementation(attn)
    return model


def stress_forest(seed: int = 0):
    r = random.Random(seed)
    tok = lambda n: [r.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(131)
    seqs = [stem] + [stem[:p] + tok(2) for p in (63, 64, 65, 127, 128, 129)]  # branch points on and off the grid
    seqs.append(stem[:40])  # a prefix of another sequence
    seqs += [list(stem[:70]), list(stem[:70])]  # duplicates
    root = tok(1)
    seqs += [root + [k] + tok(2) for k in range(10)]  # a root with many children
    base, c = tok(5), tok(3)
    seqs += [base + c[:k] + [VOCAB - 1 - k] for k in range(4)]  # segments of 1 token below consecutive branch points
    path = tok(2)
    for _ in range(31):  # depth >= 30: 2-token segments, each with a 1-token leaf beside it
        nxt = tok(2)
        seqs.append(path + [(nxt[0] + 1) % VOCAB])
        path = path + nxt
    seqs.append(path)
    return seqs


def embedding_grads(model):
    """Captures the input embeddings' outputs (retaining their gradient) of every forward."""
    seen = []

    def hook(module, args, out):
        out.retain_grad()
        seen.append(out)

    return seen, model.get_input_embeddings().register_forward_hook(hook)


@needs_torch(transformers=True)
class Segments(unittest.TestCase):
    def test_segments_and_run_plans_of_the_stress_forest(self):
        batch = tpt.load_microbatch(pack(stress_forest(), pad=3))
        parent, N = batch.parent.numpy(), batch.num_nodes
        seg = tpt.radix_segments(batch.subtree_end)
        children = [0] * N
        for p in parent[parent >= 0]:
            children[p] += 1
        covered = []
        for k in range(len(seg.start)):
            s, n = int(seg.start[k]), int(seg.length[k])
            covered += range(s, s + n)
            for i in range(s + 1, s + n):  # inside a segment: a chain of single children
                self.assertEqual(parent[i], i - 1)
                self.assertEqual(children[i - 1], 1)
            self.assertTrue(parent[s] < 0 or children[parent[s]] != 1 or parent[s] != s - 1 or s == 0)  # maximal
            p = int(seg.parent[k])
            self.assertEqual(
                p,
                -1
                if parent[s] < 0
                else int(next(j for j in range(len(seg.start)) if seg.start[j] <= parent[s] < seg.start[j] + seg.length[j])),
            )
            self.assertEqual(int(seg.offset[k]), int(batch.position_ids[s]))
            self.assertEqual(int(seg.depth[k]), 0 if p < 0 else int(seg.depth[p]) + 1)
        self.assertEqual(sorted(covered), list(range(N)))
        self.assertGreaterEqual(seg.num_levels, 31)
        self.assertIn(1, seg.length.tolist())
        self.assertIn(2, seg.length.tolist())
        mask = tpt.tree_mask(batch)
        self.assertIs(tpt.segments_of(mask), tpt.segments_of(mask))  # cached on the mask
        from treepack.torch.segments import run_plan

        for align in (1, 64):
            plan = run_plan(mask, align, torch.device("cpu"))
            flat = torch.cat([c.nodes.flatten() for c in plan.calls])
            self.assertTrue(torch.equal(torch.sort(flat[plan.owner]).values, torch.arange(N)))  # each node's output, from a row holding it
            for c in plan.calls:
                for row in c.nodes.tolist():
                    row = [t for t in row if t < N]
                    self.assertEqual(int(batch.position_ids[row[0]]) % align, 0)  # rows start on the chunk grid
                    self.assertTrue(all(parent[b] == a for a, b in zip(row, row[1:])))  # a row is a path
            if align == 1:
                self.assertEqual(plan.tokens, N)  # no repeated work


@needs_torch(transformers=True)
class HybridEqualsUnpacked(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.batch = tpt.load_microbatch(pack(stress_forest(), pad=3))

    def packed_run(self, model, batch):
        """Per-occurrence logprobs and entropies, the loss (backpropagated), the embedding gradient per node and the
        parameter gradients, packed."""
        seen, hook = embedding_grads(model)
        try:
            scores = tpt.packed_logprobs(model, batch, nodes="all", entropy=True, attention="block")
            lp, ent = tpt.gather_occurrences(scores.logprobs, batch), tpt.gather_occurrences(scores.entropy, batch)
            loss = objective(lp, ent, batch)
            loss.backward()
        finally:
            hook.remove()
        return lp.detach(), ent.detach(), loss.detach(), seen[0].grad[0], {n: p.grad for n, p in model.named_parameters()}

    def unpacked_run(self, model, batch):
        """The same, each sequence alone (a node's embedding gradient: the sum of its occurrences')."""
        seen, hook = embedding_grads(model)
        try:
            lp, ent = unpacked_logprobs(model, batch)
            loss = objective(lp, ent, batch)
            loss.backward()
        finally:
            hook.remove()
        lengths = (batch.seq_offsets[1:] - batch.seq_offsets[:-1]).tolist()
        ran = iter(seen)  # sequences of one token never ran
        occ = torch.cat([next(ran).grad[0] if n >= 2 else torch.zeros(n, seen[0].shape[-1], dtype=seen[0].dtype) for n in lengths])
        emb = torch.zeros(batch.num_nodes, occ.shape[-1], dtype=occ.dtype).index_add_(0, batch.seq_positions, occ)
        return lp.detach(), ent.detach(), loss.detach(), emb, {n: p.grad for n, p in model.named_parameters()}

    def assert_equal_runs(self, packed, unpacked, batch, tol):
        t = batch.token_index > 0  # the occurrences a logprob is defined at
        self.assertLess(float((packed[0][t] - unpacked[0][t]).abs().max()), tol, "logprobs")
        self.assertLess(float((packed[1][t] - unpacked[1][t]).abs().max()), tol, "entropy")
        self.assertLess(abs(float(packed[2] - unpacked[2])), tol, "loss")
        self.assertLess(float((packed[3] - unpacked[3]).abs().max()), tol, "embedding gradient")
        for name, g in packed[4].items():
            self.assertEqual(g is None, unpacked[4][name] is None, name)
            if g is not None:
                self.assertLess(float((g - unpacked[4][name]).abs().max()), tol, name)

    def test_float64_every_family_with_and_without_chunk_alignment(self):
        for family in FAMILIES:
            plain = hybrid_model(family, attn="sdpa")
            models = {align: tpt.prepare(copy.deepcopy(plain), chunk_align=align) for align in (False, True)}
            unpacked = self.unpacked_run(plain, self.batch)
            for align, packed in models.items():
                with self.subTest(family=family, chunk_align=align):
                    packed.set_attn_implementation("treepack")
                    self.assert_equal_runs(self.packed_run(packed, self.batch), unpacked, self.batch, 1e-10)

    def test_families_sharing_the_layers_forward(self):
        # Bamba, Granite-4 hybrids, Falcon-H1, Zamba2 (Mamba2 mixers), OLMo-Hybrid and Qwen3.5-MoE (Gated DeltaNet):
        # the stock code in float64 weights (its float32 casts kept: the GDN recurrences then round at float32).
        batch = tpt.load_microbatch(pack(stress_forest(seed=1)[:24], pad=1))
        t = batch.token_index > 0
        for family, (cls_name, cfg) in _sharing_configs().items():
            with self.subTest(family=family):
                cfg._experts_implementation = "eager"  # grouped_mm has no float64
                torch.manual_seed(0)
                plain = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls_name)(cfg).double().eval()
                plain.set_attn_implementation("sdpa")
                packed = tpt.prepare(copy.deepcopy(plain))
                packed.set_attn_implementation("treepack")
                self.assertTrue(any(hasattr(type(m), "treepack_base") for m in packed.modules()))
                with torch.no_grad():
                    lp = tpt.gather_occurrences(tpt.packed_logprobs(packed, batch, nodes="all").logprobs, batch)
                    lp_u, _ = unpacked_logprobs(plain, batch)
                self.assertLess(float((lp[t] - lp_u[t]).abs().max()), 1e-7)

    def test_copies_training_mode_and_gradient_checkpointing(self):
        # A deep copy of a prepared model stays prepared (trainers copy the policy); training mode sends Mamba2 to its
        # fused path first (None without mamba-ssm, refused on a tree where installed); checkpointing recomputes layers.
        batch = tpt.load_microbatch(pack(stress_forest(seed=1)[:24], pad=1))
        for family in ("qwen3_5", "nemotron_h"):
            with self.subTest(family=family):
                plain = hybrid_model(family, attn="sdpa")
                packed = copy.deepcopy(tpt.prepare(copy.deepcopy(plain)))
                packed.set_attn_implementation("treepack")
                packed.gradient_checkpointing_enable()
                packed.train()
                self.assert_equal_runs(self.packed_run(packed, batch), self.unpacked_run(plain, batch), batch, 1e-10)

    def test_stock_float32_bound_with_packed_loss(self):
        # The stock code (float32 conv, recurrence and norms) with the packed loss on both sides: packed and
        # unpacked agree to float32 rounding; the bound is printed.
        config = {"clip_low": 0.2, "clip_high": 0.28, "kl": "k3", "kl_coef": 0.01}
        batch = tpt.load_microbatch(pack(stress_forest(seed=2)[:30], pad=2))
        naive = {
            "seq_offsets": batch.seq_offsets,
            "seq_positions": torch.arange(batch.num_occurrences),
            "loss_mask": batch.loss_mask,
            "advantages": batch.advantages,
            "old_logprobs": batch.old_logprobs,
            "ref_logprobs": batch.ref_logprobs,
        }
        for family in FAMILIES:
            with self.subTest(family=family):
                plain = hybrid_model(family, float64=False, attn="sdpa")
                packed = tpt.prepare(copy.deepcopy(plain))
                packed.set_attn_implementation("treepack")
                lp = tpt.packed_logprobs(packed, batch).logprobs
                loss_p, _ = tpt.packed_loss(lp, batch, config)
                lp_u, _ = unpacked_logprobs(plain, batch)
                loss_u, _ = tpt.packed_loss(lp_u, naive, config)
                loss_p.backward()
                loss_u.backward()
                m = batch.loss_mask
                d_lp = float((tpt.gather_occurrences(lp, batch)[m] - lp_u[m]).detach().abs().max())
                grads = dict(plain.named_parameters())
                d_g = max(
                    float((p.grad - grads[n].grad).abs().max()) / max(float(grads[n].grad.abs().max()), 1e-30)
                    for n, p in packed.named_parameters()
                    if p.grad is not None
                )
                d_loss = abs(float((loss_p - loss_u).detach()))
                print(
                    f"\nstock float32 {family}: max |logprob diff| {d_lp:.2g}, loss diff {d_loss:.2g}, max relative gradient diff {d_g:.2g}"
                )
                self.assertLess(d_lp, 1e-4)
                self.assertLess(d_loss, 1e-5)
                self.assertLess(d_g, 1e-3)

    def test_negative_control_the_packed_row_without_tree_execution_differs(self):
        # The dense tree mask reaches the attention layers; the recurrent layers then run the packed row as one
        # sequence: what packed_logprobs refuses on the dense path (and what prepare() exists for).
        for family in ("qwen3_5", "nemotron_h"):
            with self.subTest(family=family):
                model = hybrid_model(family, attn="sdpa")
                mask = tpt.dense_tree_mask(self.batch.subtree_end)[None, None]
                with torch.no_grad():
                    logits = model(
                        self.batch.input_ids[None], position_ids=self.batch.position_ids[None], attention_mask=mask, use_cache=False
                    ).logits[0]
                    lp = torch.log_softmax(logits, -1)[self.batch.parent.clamp(min=0), self.batch.input_ids]
                    lp_u, _ = unpacked_logprobs(model, self.batch)
                t = self.batch.token_index > 0
                self.assertGreater(float((tpt.gather_occurrences(lp, self.batch)[t] - lp_u[t]).abs().max()), 1e-3)
                with self.assertRaisesRegex(TreepackError, r"layer 0 .*mixes tokens"):
                    tpt.packed_logprobs(model, self.batch)

    def test_stock_float32_rules_bit_exact_with_chunk_alignment(self):
        # Where packing acts: the stock float32 convolution and chunked rules on the same per-token inputs, packed
        # (tree) and per sequence. (Whole layers are compared at the float64 tolerance above: their projections are
        # matmuls whose per-row results CPU BLAS does not keep independent of the row count, packed or not.)
        for name, align, exact, diff in rule_diffs(self.batch, torch.device("cpu"), torch.float32):
            with self.subTest(fn=name, chunk_align=align):
                print(f"\nstock float32 {name}, chunk_align={align}: max |packed - unpacked| = {diff:.3g}")
                if exact:
                    self.assertEqual(diff, 0.0)  # bit for bit
                else:
                    # float32 rounding: segments off the chunk grid; Mamba2 combines chunk states all at once; CPU
                    # conv1d itself rounds differently for different sequence lengths (the unpacked runs too).
                    self.assertLess(diff, 1e-4)


def rule_diffs(batch, device, dtype):
    """(function, chunk_align, expected bit for bit, max |packed - unpacked|) for the convolution and chunked rules
    transformers binds now (the pure-torch references, or FLA / causal-conv1d / mamba-ssm kernels where installed),
    on random per-token inputs: run on the tree, and per sequence."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.nemotron_h import modeling_nemotron_h as nemo
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    from treepack.torch import recurrent

    mask = tpt.tree_mask(batch.to(device))
    N, H, D = batch.num_nodes, 2, 8
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn((1, N) + shape, generator=g).to(device, dtype)  # noqa: E731
    q, k, v = rnd(H, D), rnd(H, D), rnd(H, D)
    beta, decay = torch.sigmoid(rnd(H)), -torch.rand((1, N, H), generator=g).to(device, dtype)
    x, w = torch.randn((1, 3 * D, N), generator=g).to(device, dtype), torch.randn((3 * D, 4), generator=g).to(device, dtype)
    dt, A, Bm, Cm = rnd(H), -torch.rand(H, generator=g).to(device), rnd(1, D), rnd(1, D)
    ones = torch.ones(H, device=device)
    cases = {
        "causal_conv1d_fn": (qwen.causal_conv1d_fn, lambda f, t: f(t(x, 2), w, activation="silu"), recurrent.tree_conv, 2),
        "torch_chunk_gated_delta_rule": (
            qwen.torch_chunk_gated_delta_rule,
            lambda f, t: f(t(q), t(k), t(v), g=t(decay), beta=t(beta), use_qk_l2norm_in_kernel=True)[0],
            recurrent.tree_chunk_rule,
            1,
        ),
        "chunk_kimi_delta_attention": (
            kimi.chunk_kimi_delta_attention,
            lambda f, t: f(t(q), t(k), t(v), g=t(decay[..., None].expand(1, N, H, D)), beta=t(beta), use_qk_l2norm_in_kernel=True)[0],
            recurrent.tree_chunk_rule,
            1,
        ),
        "mamba2_chunk_scan": (
            nemo.mamba2_chunk_scan,
            lambda f, t: f(
                t(v), t(dt), A, t(Bm), t(Cm), chunk_size=64, D=ones, dt_bias=ones, dt_softplus=True, dt_limit=(1e-3, float("inf"))
            ),
            recurrent.tree_mamba2_scan,
            1,
        ),
    }
    seq_positions = batch.seq_positions.to(device)
    for name, (fn, apply, kind, dim) in cases.items():
        for align in (True, False):
            tree = recurrent.Tree(mask, align, name)
            with torch.no_grad():
                packed = apply(functools.partial(kind, fn, tree), lambda t, d=1: t)
                unpacked = []
                for i in range(batch.num_sequences):
                    pos = seq_positions[int(batch.seq_offsets[i]) : int(batch.seq_offsets[i + 1])]
                    unpacked.append(apply(fn, lambda t, d=1, pos=pos: t.index_select(d, pos)))
            diff = float((packed.index_select(dim, seq_positions) - torch.cat(unpacked, dim)).abs().max())
            yield name, align, align and kind is recurrent.tree_chunk_rule, diff


@needs_torch(transformers=True, cuda="the CUDA kernels transformers binds (FLA, causal-conv1d, mamba-ssm) need a CUDA device")
class HybridCuda(unittest.TestCase):
    def test_cuda_rules_on_the_tree_equal_per_sequence(self):
        # Whatever transformers binds on this host (FLA's chunk_gated_delta_rule / chunk_kda, causal-conv1d,
        # mamba-ssm's chunk scan, or the pure-torch references on the GPU), called as treepack calls it: a batch of
        # rows with per-row initial states. bfloat16 (FLA refuses float32): equal up to its rounding, where a state
        # leaking across branches would differ by O(1).
        batch = tpt.load_microbatch(pack(stress_forest(), pad=3))
        for name, align, _, diff in rule_diffs(batch, torch.device("cuda"), torch.bfloat16):
            with self.subTest(fn=name, chunk_align=align):
                print(f"\nCUDA bfloat16 {name}, chunk_align={align}: max |packed - unpacked| = {diff:.3g}")
                self.assertLess(diff, 5e-2)


@needs_torch(transformers=True)
class EntryPoints(unittest.TestCase):
    def test_causal_lm_forward_with_tree_mask_and_logits_to_keep(self):
        batch = tpt.load_microbatch(pack(stress_forest(seed=1)[:20], pad=2))
        for family in ("qwen3_5", "nemotron_h"):
            with self.subTest(family=family):
                model = tpt.prepare(hybrid_model(family))
                keep = torch.unique(batch.parent[batch.parent >= 0])
                with torch.no_grad():
                    logits = model(
                        input_ids=batch.input_ids[None],
                        position_ids=batch.position_ids[None],
                        attention_mask=tpt.tree_mask(batch),
                        logits_to_keep=keep,
                    ).logits[0]
                    child = torch.nonzero(batch.parent >= 0).flatten()
                    row = torch.searchsorted(keep, batch.parent[child])
                    lp = torch.log_softmax(logits.double(), -1)[row, batch.input_ids[child]]
                    ref = tpt.packed_logprobs(model, batch, nodes="all").logprobs[child]
                self.assertLess(float((lp - ref).abs().max()), 1e-12)

    def test_grpo_example_on_a_qwen3_5_checkpoint(self):
        # examples/grpo_step.py unchanged, given a saved tiny Qwen3.5: packed and unpacked steps agree.
        import json
        import os
        import subprocess
        import tempfile

        import transformers

        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
        cfg = _configs()["qwen3_5"][1]
        cfg.vocab_size = 512
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(tmp)
            res = subprocess.run(
                [sys.executable, os.path.join(root, "examples", "grpo_step.py"), "--model", tmp, "--json", "--max-tokens", "2048"],
                capture_output=True,
                text=True,
                cwd=root,
                timeout=300,
            )
        self.assertEqual(res.returncode, 0, res.stderr[-3000:])
        out = json.loads(res.stdout.strip().splitlines()[-1])
        self.assertLess(out["packed_tokens"], out["naive_tokens"])
        self.assertLess(abs(out["loss_packed"] - out["loss_unpacked"]), 1e-5 * max(1.0, abs(out["loss_unpacked"])))
        self.assertLess(out["max_weight_difference_after_step"], 1e-5)

    def test_unsupported_layers_are_refused_by_class_and_index(self):
        import transformers

        cfg = transformers.Lfm2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            layer_types=["full_attention", "conv"],
            max_position_embeddings=128,
        )
        model = transformers.Lfm2ForCausalLM(cfg).eval()
        model.set_attn_implementation("treepack")
        with self.assertRaisesRegex(ValueError, r"layer 1 .*Lfm2ShortConv mixes tokens"):
            tpt.prepare(model)
        batch = tpt.load_microbatch(pack([[1, 2, 3], [1, 2, 4]]))
        with self.assertRaisesRegex(ValueError, r"Lfm2ShortConv"):
            tpt.packed_logprobs(model, batch)

        class MyRecurrence(torch.nn.Module):  # an unknown token mixer inside a supported model
            def forward(self, x):
                return x.cumsum(1)

        hybrid = hybrid_model("qwen3_5")
        hybrid.model.layers[1].mlp.extra = MyRecurrence()
        with self.assertRaisesRegex(ValueError, r"layer 1 .*MyRecurrence"):
            tpt.prepare(hybrid)
        # A Mamba1 model: its mixer is named, not the decoder layer or model named after it.
        mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4))
        with self.assertRaisesRegex(ValueError, r"layer 0 \(backbone.layers.0.mixer\): MambaMixer mixes tokens"):
            tpt.prepare(mamba)

    def test_mismatched_inputs(self):
        batch = tpt.load_microbatch(pack([[1, 2, 3, 4], [1, 2, 5]]))
        for family in ("qwen3_5", "nemotron_h"):  # not prepared: a TreeMask is refused, never run as one sequence
            with self.subTest(family=family), self.assertRaisesRegex(ValueError, r"prepare\(model\)"):
                hybrid_model(family)(
                    input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=tpt.tree_mask(batch)
                )
        model = tpt.prepare(hybrid_model("qwen3_5"))
        other = tpt.tree_mask(tpt.load_microbatch(pack([[1, 2, 3], [1, 2, 5]])))
        with self.assertRaisesRegex(ValueError, "one packed row of N = 4"):
            model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=other)
        with self.assertRaisesRegex(ValueError, "past_key_values"):
            import transformers

            model(
                input_ids=batch.input_ids[None],
                position_ids=batch.position_ids[None],
                attention_mask=tpt.tree_mask(batch),
                past_key_values=transformers.DynamicCache(config=model.config),
            )
        with self.assertRaisesRegex(ValueError, "align"):
            from treepack.torch.segments import run_plan

            run_plan(tpt.tree_mask(batch), 0, torch.device("cpu"))
        with self.assertRaisesRegex(ValueError, "chunk_align"):
            tpt.prepare(model, chunk_align="yes")

    def test_prepared_models_run_plain_inputs_unchanged(self):
        # Without a TreeMask a prepared layer is the stock layer: the same outputs bit for bit (generation, references).
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
        for family in ("qwen3_5", "nemotron_h"):
            with self.subTest(family=family):
                plain = hybrid_model(family, float64=False, attn="sdpa")
                prepared = tpt.prepare(copy.deepcopy(plain))
                with torch.no_grad():
                    self.assertTrue(torch.equal(prepared(ids).logits, plain(ids).logits))


if __name__ == "__main__":
    unittest.main()
