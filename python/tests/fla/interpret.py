"""What FLA's Triton kernels need to run under Triton's interpreter (``TRITON_INTERPRET=1``) on a host without a GPU:
two patches of Triton's runtime, applied by ``install()`` before any kernel runs. Test code only: the shipped package
never imports this module, and on a CUDA device (``TRITON_INTERPRET`` unset) nothing is patched.

Written against triton 3.6.0 with fla-core / flash-linear-attention 0.5.2 (python/requirements-fla.txt pins them);
each patch checks that the code it replaces still has the shape it was written for, and fails loudly otherwise.

1. The autotuner benchmarks every config on the active driver; the interpreter has none (``RuntimeError: 0 active
   drivers``), and FLA's autotuners also keep their results in Triton's disk cache, keyed by the driver's target.
   Patched: every config "measures" the same, so the autotuner keeps the first config its pruning leaves (the
   pruning still runs), and the disk cache is bypassed. Any config computes the same function; which one only
   changes the summation order, the same on the packed and the unpacked side.
2. The interpreter runs a kernel's ``for i in range(n)`` as a Python loop, so ``i`` is a Python int where compiled
   Triton gives a tensor: FLA's ``i_t.to(tl.int64)`` then fails (``'int' object has no attribute 'to'``). Patched:
   the interpreter's rewrite of a kernel's source (it already turns every assigned value into an interpreter
   tensor) also turns the variable of a ``range`` / ``tl.range`` loop into one at the top of the body;
   ``tl.static_range`` loops keep constexpr ints, as when compiled.

A third requirement is the environment's: numpy < 2.4, whose ``int()`` of a 1-element array the interpreter relies
on (numpy 2.4 refuses it; requirements-fla.txt pins numpy). bfloat16 is wrong under the interpreter (it computes in
numpy, which has no bfloat16): the interpreted tests run float32 only.
"""

from __future__ import annotations

import ast
import os

_installed = False


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (read by Triton itself at each launch)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def install() -> None:
    """Applies both patches (idempotent). Call before the first kernel launch, with ``TRITON_INTERPRET=1`` set."""
    global _installed
    if _installed:
        return
    if not interpreting():
        raise RuntimeError("interpret.install() patches Triton's interpreter: set TRITON_INTERPRET=1 first")
    from triton.runtime import autotuner, interpreter

    tuner = autotuner.Autotuner
    for name in ("_bench", "check_disk_cache"):
        if not callable(getattr(tuner, name, None)):
            raise RuntimeError(f"triton.runtime.autotuner.Autotuner.{name} is gone: interpret.py was written for triton 3.6")

    def bench(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]  # equal timings: min() keeps the first config

    def disk_cache(self, tuning_key, configs, bench_fn):
        bench_fn()
        return False

    tuner._bench = bench
    tuner.check_disk_cache = disk_cache

    base = interpreter.ASTTransformer
    if not isinstance(getattr(interpreter.FunctionRewriter, "ast_transformer", None), base):
        raise RuntimeError("triton.runtime.interpreter.FunctionRewriter.ast_transformer is gone: interpret.py was written for triton 3.6")

    class LoopTensors(base):
        def visit_For(self, node: ast.For) -> ast.For:
            self.generic_visit(node)
            it = node.iter
            fn = it.func if isinstance(it, ast.Call) else None
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name == "range" and isinstance(node.target, ast.Name):
                v = node.target.id
                wrap = ast.parse(f"{v} = interpreter_semantic.to_tensor({v}, False)").body[0]
                node.body.insert(0, wrap)
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopTensors()
    _installed = True
