"""treepack's tree execution of the recurrent layers (python/treepack/torch/recurrent.py) bound to FLA's Triton chunk
kernels: Gated DeltaNet's ``chunk_gated_delta_rule`` and KDA's ``chunk_kda``, as transformers binds them once
flash-linear-attention is installed.

Where it runs: in .venv-fla (python/requirements-fla.txt; never the main .venv, whose CPU path FLA would change)
with ``TRITON_INTERPRET=1``, Triton's interpreter executing the kernels on the CPU after the patches of
interpret.py (float32 only: bfloat16 is wrong under the interpreter); or on a CUDA device with ``TRITON_INTERPRET``
unset (scripts/gpu-check.sh), where the same checks run compiled and bfloat16 is checked too. Elsewhere every test
skips with the reason.

What is checked, on forests whose branch points sit on and beside the 64-token chunk grid (63 / 64 / 65), with a
segment of one token, a sequence that is a prefix of another, duplicates and a second root:
- the bound function is FLA's and its kernels are what ran (launches counted, interpreted when interpreting);
- with ``chunk_align=True`` the packed run equals the unpacked FLA run (each sequence alone) bit for bit: outputs,
  and the gradients, with respect to every input, of a loss on one sequence's own tokens (torch.equal);
- negative controls: the same comparison fails when the parents' states are moved by one ulp, and without chunk
  alignment (segments starting off the grid are chunked differently, so the rounding differs);
- packed FLA (both alignments) against transformers' pure-torch reference run per sequence: outputs and the
  gradients of a loss over every occurrence within float32 tolerances, measured and printed (FLA and the reference
  sum in different orders, and the packed run shares each prefix's state across branches);
- a tiny Qwen3.5 model (its Gated DeltaNet layer prepared by treepack.torch.prepare) packed with FLA against the
  stock model per sequence with the torch reference: logprobs and parameter gradients within float32 tolerance.
  (Whole models are not compared bit for bit: their projections are matmuls whose per-row results CPU BLAS does
  not keep independent of the row count; the rules above are where packing acts.)
"""

import contextlib
import copy
import importlib.util
import inspect
import os
import random
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "trainer"))  # support.py and the tiny hybrid models

import interpret  # noqa: E402

INTERPRET = interpret.interpreting()
MISSING = [m for m in ("torch", "transformers", "triton", "fla") if importlib.util.find_spec(m) is None]
if not MISSING and INTERPRET:
    interpret.install()  # before any kernel runs

from support import needs_torch, pack, torch, tpt  # noqa: E402

if torch is not None and not MISSING:
    from test_exactness import unpacked_logprobs
    from test_hybrid import hybrid_model
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    from treepack.torch import recurrent

    # As transformers bound them at import (FLA's, behind its hub wrapper), before prepare() puts treepack's
    # dispatchers in front of these module globals.
    GDN, KDA = qwen.torch_chunk_gated_delta_rule, kimi.chunk_kimi_delta_attention

if MISSING:
    SKIP = f"{', '.join(MISSING)} not importable (python/requirements-fla.txt: node scripts/python-env.mjs --fla)"
elif torch is None:
    SKIP = "torch not importable"
elif not INTERPRET and not torch.cuda.is_available():
    SKIP = "FLA's kernels need TRITON_INTERPRET=1 (Triton's interpreter) or a CUDA device"
else:
    SKIP = ""
DEVICE = "cpu" if INTERPRET else "cuda"
VOCAB = 61
# Float32 bounds against the pure-torch reference, about 10x what the interpreter measured (outputs <= 3.7e-7, a few
# ulps of values of order 1; gradients <= 3.1e-6 of the largest): FLA and the reference sum in different orders (FLA
# in 16-token sub-chunks, the reference through a triangular solve), and a packed run hands states across branches.
OUT_TOL, GRAD_TOL, LOGPROB_TOL = 4e-6, 4e-5, 1e-5
if not INTERPRET:
    # Compiled on NVIDIA, FLA's float32 tl.dot runs in TF32 (10-bit mantissa): about 1e-3 relative, not yet measured.
    OUT_TOL, GRAD_TOL, LOGPROB_TOL = 1e-2, 5e-2, 1e-2


def fla_function(bound):
    """The FLA function behind transformers' hub wrapper (``use_kernel_func_from_hub_with_fallback``), or None."""
    impl = inspect.getclosurevars(inspect.unwrap(bound, stop=lambda f: "implementation" in inspect.getclosurevars(f).nonlocals)).nonlocals
    return impl.get("implementation")


def reference(bound):
    """transformers' pure-torch function under the hub wrapper (``functools.wraps`` keeps it as __wrapped__)."""
    fn = inspect.unwrap(bound)
    assert fn.__module__.startswith("transformers.models."), fn.__module__
    return fn


@contextlib.contextmanager
def launches():
    """Counts Triton kernel launches by kernel name: the interpreter's (InterpretedFunction) or compiled ones (JITFunction)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen = {}
    saved = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def counting(cls):
        def run(self, *args, **kwargs):
            name = f"{type(self).__name__}:{self.fn.__name__}"
            seen[name] = seen.get(name, 0) + 1
            return saved[cls](self, *args, **kwargs)

        return run

    for cls in saved:
        cls.run = counting(cls)
    try:
        yield seen
    finally:
        for cls, run in saved.items():
            cls.run = run


def forest(seed, stem_len, branches, extra):
    """A stem with 2-token branches at ``branches`` (63 / 64 / 65: on and beside the chunk grid), ``extra`` more
    shapes (a prefix of another sequence, duplicates, a 1-token segment, a second root) drawn from ``seed``."""
    r = random.Random(seed)
    tok = lambda n: [r.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
    stem = tok(stem_len)
    seqs = [stem] + [stem[:p] + tok(2) for p in branches]
    if extra:
        one = tok(1)
        seqs += [stem[:40], stem[:66] + one, stem[:66] + one, stem[:66] + one + tok(2)]  # prefix, duplicates, 1-token segment
        root = tok(2)
        seqs += [root + tok(3), root + tok(1)]
    return seqs


class Case:
    """Random per-token inputs of a delta rule on a packed forest, and the rule run packed (on the tree) or per
    sequence, as per-occurrence outputs [M, H, V]."""

    def __init__(self, seqs, heads, dim, kda, dtype=torch.float32 if torch else None):
        self.batch = tpt.load_microbatch(pack(seqs)).to(DEVICE)
        self.mask = tpt.tree_mask(self.batch)
        self.pos = self.batch.seq_positions
        N = self.batch.num_nodes
        g = torch.Generator().manual_seed(0)
        rnd = lambda *s: torch.randn((1, N) + s, generator=g)  # noqa: E731
        decay = -torch.rand((1, N, heads, dim) if kda else (1, N, heads), generator=g)
        raw = {"q": rnd(heads, dim), "k": rnd(heads, dim), "v": rnd(heads, dim), "g": decay, "beta": torch.sigmoid(rnd(heads))}
        self.inputs = {n: t.to(DEVICE, dtype).requires_grad_() for n, t in raw.items()}
        self.inputs["g"] = self.inputs["g"].detach().float().requires_grad_()  # FLA keeps the decay in float32
        self.bound = KDA if kda else GDN

    def packed(self, fn, align):
        x = self.inputs
        out, _ = recurrent.tree_chunk_rule(
            fn, recurrent.Tree(self.mask, align, "test"), x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True
        )
        return out[0].index_select(0, self.pos)

    def unpacked(self, fn, seqs=None):
        x, outs = self.inputs, []
        for i in range(self.batch.num_sequences) if seqs is None else seqs:
            p = self.pos[int(self.batch.seq_offsets[i]) : int(self.batch.seq_offsets[i + 1])]
            t = {n: v.index_select(1, p) for n, v in x.items()}
            outs.append(fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=True)[0][0])
        return torch.cat(outs)

    def span(self, i):
        return slice(int(self.batch.seq_offsets[i]), int(self.batch.seq_offsets[i + 1]))

    def grads(self, loss):
        return torch.autograd.grad(loss, list(self.inputs.values()), retain_graph=True)


def one_ulp_up(fn):
    """``fn`` with every initial state it is given moved up by one ulp: a parent's state handed on inexactly."""

    def moved(*args, initial_state=None, **kwargs):
        if initial_state is not None:
            initial_state = torch.nextafter(initial_state, torch.full_like(initial_state, float("inf")))
        return fn(*args, initial_state=initial_state, **kwargs)

    return moved


def max_diff(a, b):
    return float((a - b).detach().abs().max())


@needs_torch(transformers=True)
@unittest.skipIf(bool(SKIP), SKIP)
class FlaOnTrees(unittest.TestCase):
    def test_fla_is_bound_and_its_kernels_run(self):
        for bound, module in ((GDN, "fla.ops.gated_delta_rule"), (KDA, "fla.ops.kda")):
            fn = fla_function(bound)
            self.assertIsNotNone(fn, bound)
            self.assertTrue(fn.__module__.startswith(module), fn.__module__)
        self.assertEqual(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), INTERPRET)
        case = Case(forest(0, 8, (), False), 1, 16, kda=False)
        with launches() as seen, torch.no_grad():
            case.packed(case.bound, True)
        kind = "InterpretedFunction" if INTERPRET else "JITFunction"
        print(f"\nFLA kernels launched ({DEVICE}): {seen}")
        self.assertTrue(any(k.startswith(kind) and "chunk" in k for k in seen), seen)
        self.assertFalse(any(not k.startswith(kind) for k in seen), seen)

    def check_rule(self, case, leaves):
        fla = case.bound
        ref = reference(fla)
        w = torch.randn(case.batch.num_occurrences, *case.inputs["v"].shape[2:], generator=torch.Generator().manual_seed(1)).to(DEVICE)
        name = fla_function(fla).__name__
        with launches() as seen:
            aligned = case.packed(fla, True)
        self.assertTrue(seen, "no Triton kernel ran")

        # Bit for bit: outputs, and the gradients of a loss on each chosen sequence's own tokens (their nodes in no
        # other sequence). A loss on shared tokens is not compared bit for bit: a parent's tail re-run in several
        # branch rows gets its output from the first and its state gradient summed over all of them, in another
        # order than the unpacked kernel's sum (it is compared with the reference below).
        with torch.no_grad():
            unpacked = case.unpacked(fla)
        self.assertTrue(torch.equal(aligned.detach(), unpacked), f"{name}: max |packed - unpacked| = {max_diff(aligned, unpacked):.3g}")
        private = torch.bincount(case.pos, minlength=case.batch.num_nodes)[case.pos] == 1
        for i in leaves:
            s = case.span(i)
            own = w[s] * private[s].view(-1, *[1] * (w.dim() - 1))
            self.assertTrue(bool(private[s].any()), i)
            g_packed = case.grads((aligned[s] * own).sum())
            g_alone = case.grads((case.unpacked(fla, [i]) * own).sum())
            for n, a, b in zip(case.inputs, g_packed, g_alone):
                self.assertTrue(torch.equal(a, b), f"{name}, sequence {i}, d/d{n}: max diff {max_diff(a, b):.3g}")

        # Negative controls: one ulp in the handed-on states, and rows off the chunk grid.
        with torch.no_grad():
            moved = case.packed(one_ulp_up(fla), True)
            unaligned = case.packed(fla, False)
        print(
            f"\n{name}: aligned packed == unpacked bit for bit; states moved one ulp: {max_diff(moved, unpacked):.3g}; "
            f"unaligned: {max_diff(unaligned, unpacked):.3g}"
        )
        self.assertFalse(torch.equal(moved, unpacked))
        self.assertFalse(torch.equal(unaligned, unpacked))
        self.assertLess(max_diff(unaligned, unpacked), OUT_TOL)

        # Against transformers' pure-torch reference, per sequence: outputs and the gradients of a loss over all.
        want = case.unpacked(ref)
        g_want = case.grads((want * w).sum())
        for align in (True, False):
            got = aligned if align else case.packed(fla, False)
            g_got = case.grads((got * w).sum())
            d_out = max_diff(got, want)
            d_grad = max(max_diff(a, b) / float(b.abs().max()) for a, b in zip(g_got, g_want))
            print(f"{name}, chunk_align={align}: vs the torch reference: outputs {d_out:.3g}, gradients {d_grad:.3g} (relative)")
            self.assertLess(d_out, OUT_TOL)
            self.assertLess(d_grad, GRAD_TOL)

    def test_gated_delta_rule_on_a_forest(self):
        seqs = forest(1, 70, (63, 64, 65), True)
        # Gradients bit for bit for the branches at 63 and 65 (beside the grid), the sequence below the 1-token segment,
        # and one of the second root.
        self.check_rule(Case(seqs, 2, 16, kda=False), leaves=(1, 3, 7, 9))

    def test_kda_on_a_small_forest(self):
        # chunk_kda's intra-chunk kernel dominates under the interpreter: a small forest, one head of 8 channels.
        seqs = forest(2, 66, (64, 65), False)
        self.check_rule(Case(seqs, 1, 8, kda=True), leaves=(1, 2))


@needs_torch(transformers=True)
@unittest.skipIf(bool(SKIP), SKIP)
class FlaInAPreparedModel(unittest.TestCase):
    def test_qwen3_5_packed_with_fla_equals_the_torch_reference_per_sequence(self):
        batch = tpt.load_microbatch(pack(forest(3, 67, (63, 65), False), pad=1)).to(DEVICE)
        plain = hybrid_model("qwen3_5", float64=False, attn="sdpa").to(DEVICE)
        packed = tpt.prepare(copy.deepcopy(plain), chunk_align=True)
        packed.set_attn_implementation("treepack")
        with launches() as seen:
            lp = tpt.gather_occurrences(tpt.packed_logprobs(packed, batch).logprobs, batch)
        self.assertTrue(any("chunk" in k for k in seen), seen)
        m = batch.loss_mask
        lp[m].sum().backward()

        bound = qwen.torch_chunk_gated_delta_rule  # treepack's dispatcher in front of transformers' FLA binding
        self.assertIs(bound.treepack_original, GDN)
        qwen.torch_chunk_gated_delta_rule = reference(GDN)
        try:
            with launches() as seen_ref:
                lp_u, _ = unpacked_logprobs(plain, batch)
        finally:
            qwen.torch_chunk_gated_delta_rule = bound
        self.assertFalse(any("chunk" in k for k in seen_ref), seen_ref)
        lp_u[m].sum().backward()
        d_lp = max_diff(lp[m].detach(), lp_u[m].detach())
        grads = dict(plain.named_parameters())
        d_g = max(
            max_diff(p.grad, grads[n].grad) / max(float(grads[n].grad.abs().max()), 1e-30)
            for n, p in packed.named_parameters()
            if p.grad is not None
        )
        print(
            f"\nQwen3.5 packed with FLA vs per sequence with the torch reference: logprobs {d_lp:.3g}, "
            f"parameter gradients {d_g:.3g} (relative)"
        )
        self.assertLess(d_lp, LOGPROB_TOL)
        self.assertLess(d_g, max(1e-3, GRAD_TOL))  # test_hybrid's bound for the stock float32 code packed vs per sequence


@needs_torch(transformers=True)
@unittest.skipIf(bool(SKIP) or INTERPRET, SKIP or "bfloat16 needs a CUDA device (the interpreter computes bfloat16 wrongly)")
class FlaBfloat16(unittest.TestCase):
    def test_bfloat16_packed_equals_unpacked(self):
        for kda in (False, True):
            case = Case(forest(4, 70, (63, 64, 65), True), 2, 16, kda=kda, dtype=torch.bfloat16)
            with torch.no_grad():
                unpacked = case.unpacked(case.bound)
                for align in (True, False):
                    packed = case.packed(case.bound, align)
                    d = max_diff(packed.float(), unpacked.float())
                    same = torch.equal(packed, unpacked)
                    print(f"\nCUDA bfloat16 kda={kda}, chunk_align={align}: max |packed - unpacked| = {d:.3g}, bit for bit: {same}")
                    self.assertLess(d, 5e-2)


if __name__ == "__main__":
    unittest.main()
