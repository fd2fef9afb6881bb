"""Tree execution of the short causal convolution and of the chunked recurrences (Gated DeltaNet, KDA, Mamba2).

A Hugging Face recurrent layer calls a few functions of its modeling module: ``causal_conv1d_fn`` and a chunked
rule (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``), each the pure-torch
reference or, where installed, the hub / FLA / mamba-ssm / causal-conv1d kernel bound to that name. ``prepare``
(python/treepack/torch/models.py) puts a dispatcher in front of each name; while a prepared layer runs on a
``TreeMask`` the dispatcher runs the same function the tree's way, else it calls the function unchanged:

- the convolution runs on the packed row, then the outputs of the nodes whose window crosses a branch point (or
  starts after other tokens) are recomputed on their true windows (their K-1 nearest ancestors, zeros past the
  root): gathered with index_select, so a shared token's gradient is summed over branches by autograd;
- the recurrence runs as the segments' rows (``segments.run_plan``), a batched call or a few per depth level, each
  row from its parent's final state (zeros at a root); outputs are gathered back per node. Padding is
  appended at a row's end as all-zero tokens, which leave these states unchanged (decay exp(0), no update).

Every kernel is called as a batch of independent rows with per-row initial states, which the pure-torch functions
and FLA / mamba-ssm accept alike, so the CUDA kernels are correct by construction; only the CPU path is tested here.

A step plan's forward (python/treepack/torch/stepplan.py) sets ``prefix`` on the TreeMask: nodes [0, prefix.rows)
of the mask are a cached chain and the layer's inputs are nodes [rows, N) only. The convolution then reads the
chain's last K-1 inputs from ``prefix.tail(key, t)`` ([1, C, t]) and the recurrence starts the roots that continue
the chain from ``prefix.state(key)`` ([1, ...]); the layer hands ``prefix.keep(key, tensor)`` its computed nodes'
last K-1 convolution inputs and the state after its last node, which a pushed segment caches and a popped one
back-propagates its gathered gradients through (the state's is the kernels' ``dht``: FLA's and mamba-ssm's
autograd functions take the final state's gradient). ``key`` names the call: (layer, "conv" | "state", ordinal).
A prefix with ``hand_over(key, out, width)`` (a shared piece's member computing one range of it) also gets each
call's output, to hand the next range what it reads.

A context-parallel forward (python/treepack/torch/context_parallel.py) sets a ``CPForward`` as the mask's prefix: the
layer's inputs are then the rank's nodes of a row split over ranks, and python/treepack/torch/cp_recurrent.py runs
them, with the states and convolution inputs of earlier ranks. A context-parallel step plan's pass
(python/treepack/torch/cp_plan.py) does the same through its hook, whose row continues a cached chain: the first
nodes read the chain's state and last inputs from the hook (``Tree.cp_prefix``).
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..microbatch import TreepackError
from .segments import RunPlan, conv_fix, run_plan, sub_forest


class Tree:
    """What a prepared layer runs on: the TreeMask, whether rows start on the chunk grid, the layer's name (errors),
    a step plan's ``prefix`` (module docstring; None outside one) and a context-parallel forward's ``cp`` (its
    LocalPart; None outside one)."""

    def __init__(self, mask: Any, chunk_align: bool, layer: str):
        self.mask = mask
        self.chunk_align = chunk_align
        self.layer = layer
        prefix: Any = getattr(mask, "prefix", None)
        # Under context parallelism the mask's prefix is the forward's CPForward, or a context-parallel step plan's
        # hook (python/treepack/torch/cp_plan.py), which names its ``part`` and the ``recurrent`` module: its
        # LocalPart, not a cached chain (python/treepack/torch/cp_recurrent.py). ``cp_prefix`` is then that hook:
        # ``keep(key, tensor, width)`` takes the rank's last inputs (width) and state (None), ``tail``/``state`` give
        # a cached chain's, which the row's first nodes read.
        across = getattr(prefix, "recurrent", None) is not None
        self.cp: Any = prefix.part if across else None
        self.cp_layers: Any = prefix.recurrent if across else None  # the cp_recurrent module
        self.cp_prefix: Any = prefix if across else None
        self.prefix = None if self.cp is not None else prefix
        self._calls: dict[str, int] = {}

    def key(self, kind: str) -> tuple[str, str, int]:
        """The prefix cache's name for this layer's next call of ``kind`` (a layer may call the convolution twice)."""
        i = self._calls.get(kind, 0)
        self._calls[kind] = i + 1
        return (self.layer, kind, i)


# The tree of the layer now running (None outside a prepared layer's tree forward).
current: contextvars.ContextVar[Tree | None] = contextvars.ContextVar("treepack_tree", default=None)


def _one_row(name: str, t: torch.Tensor, n: int, dim: int) -> None:
    if t.shape[0] != 1 or t.shape[dim] != n:
        raise TreepackError(
            "E_ARG", f"a tree forward runs one packed row of N = {n} tokens; {name} has shape {list(t.shape)}", field="attention_mask"
        )


def tree_conv(
    orig: Callable[..., Any],
    tree: Tree,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``causal_conv1d_fn`` on the tree: x [1, C, N] -> [1, C, N] (under a step plan, nodes [rows, N) only)."""
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise TreepackError("E_ARG", f"{tree.layer}: seq_idx / cu_seqlens cannot be combined with a tree", field="attention_mask")
    if tree.cp is not None:
        across: torch.Tensor = tree.cp_layers.conv(orig, tree, hidden_states, weight, bias, activation)
        return across
    pre, k = tree.prefix, int(weight.shape[-1])
    if pre is None:
        return _conv(orig, tree.mask, hidden_states, weight, bias, activation)
    rows, key = pre.rows, tree.key("conv")
    _one_row("the convolution input", hidden_states, int(tree.mask.subtree_end.shape[0]) - rows, 2)
    pre.keep(key, hidden_states[:, :, max(0, hidden_states.shape[2] - (k - 1)) :])
    t = min(k - 1, rows)
    if not t:
        return _handed(pre, key, _conv(orig, tree.mask, hidden_states, weight, bias, activation), k - 1)
    # The chain's last t nodes before the computed ones: the windows reaching into the cache read the cached inputs.
    x = torch.cat([pre.tail(key, t).to(hidden_states.dtype), hidden_states], 2)
    return _handed(pre, key, _conv(orig, sub_forest(tree.mask, rows - t), x, weight, bias, activation)[:, :, t:], k - 1)


def _handed(pre: Any, key: tuple[str, str, int], out: torch.Tensor, width: int | None) -> torch.Tensor:
    """``out`` of a layer call under a prefix; a shared piece's member (python/treepack/torch/shared_prefix.py,
    ``GroupPrefix.hand_over``) sends the next range's member what it reads (the last ``width`` convolution inputs, or
    the state: width None), its gradient returning with ``out``'s. A step plan's cached chain hands nothing over."""
    hand = getattr(pre, "hand_over", None)
    return out if hand is None else hand(key, out, width)


def _conv(
    orig: Callable[..., Any],
    mask: Any,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    n = int(mask.subtree_end.shape[0])
    _one_row("the convolution input", hidden_states, n, 2)
    fix = conv_fix(mask, int(weight.shape[-1]), hidden_states.device)
    return windows_conv(orig, hidden_states, hidden_states, fix.nodes, fix.windows, weight, bias, activation)


def windows_conv(
    orig: Callable[..., Any],
    row: torch.Tensor,
    columns: torch.Tensor,
    nodes: torch.Tensor,
    windows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """The convolution of ``row`` [1, C, n] as one sequence, with the outputs of ``nodes`` [F] recomputed on their true
    windows ``windows`` [F, k] (columns of ``columns`` [1, C, m], -1 = zero past a root)."""
    out: torch.Tensor = orig(row, weight, bias=bias, activation=activation)
    if nodes.numel() == 0:
        return out
    k, m = int(weight.shape[-1]), int(columns.shape[2])
    # The true windows [F, C, k] (the zero column m past a root) through the same function: its last output sees
    # exactly the window.
    x = F.pad(columns[0], (0, 1))
    win = x.index_select(1, torch.where(windows < 0, m, windows).flatten()).view(x.shape[0], -1, k).transpose(0, 1).contiguous()
    fixed = orig(win, weight, bias=bias, activation=activation)[:, :, k - 1]  # [F, C]
    patched: torch.Tensor = out.index_copy(2, nodes, fixed.t()[None])
    return patched


def _run(tree: Tree, chunk: int, inputs: tuple[torch.Tensor | None, ...], call: Callable[..., Any]) -> torch.Tensor:
    """Runs ``call(rows..., initial_state or None) -> (out [G, T, ...], final [G, ...])`` over the plan's calls in
    depth order; returns the nodes' outputs [1, N, ...] (under a step plan, nodes [rows, N): the roots that continue
    the cached chain start from its state; under context parallelism, the rank's nodes). The first input is always
    given (the others may be None)."""
    if inputs[0] is None:
        raise TreepackError("E_ARG", "a recurrence needs its first input", field="inputs")
    if tree.cp is not None:
        ran: torch.Tensor = tree.cp_layers.run(tree, chunk, inputs, call)
        return ran
    pre, mask = tree.prefix, tree.mask
    if pre is None:
        return run_rows(mask, chunk if tree.chunk_align else 1, inputs, call, None)[0]
    key = tree.key("state")
    mask = sub_forest(mask, pre.rows) if pre.rows else mask
    out, finals, plan = run_rows(mask, chunk if tree.chunk_align else 1, inputs, call, lambda: pre.state(key))
    if finals:
        last, r = plan.last
        pre.keep(key, finals[last][r : r + 1])
    return _handed(pre, key, out, None)


def run_rows(
    mask: Any, align: int, inputs: tuple[torch.Tensor | None, ...], call: Callable[..., Any], starts: Callable[[], torch.Tensor] | None
) -> tuple[torch.Tensor, list[torch.Tensor], RunPlan]:
    """``run_plan(mask, align)``'s calls over ``inputs`` ([1, N, ...] each, the first given): (outputs [1, N, ...], the
    calls' final states, the plan). Rows that hang (``Call.hang``) start from ``starts()`` [H, ...] (asked only when
    some row hangs), row ``hang_from``."""
    first = inputs[0]
    assert first is not None
    n = int(mask.subtree_end.shape[0])
    for t in inputs:
        if t is not None:
            _one_row("a recurrence input", t, n, 1)
    plan = run_plan(mask, align, first.device)
    # [N + 1, ...] per input, row N the all-zero padding token; each call gathers its rows from these.
    padded = [None if t is None else torch.cat([t[0], t.new_zeros((1,) + t.shape[2:])]) for t in inputs]
    finals: list[torch.Tensor] = []
    outs = []
    for c in plan.calls:
        rows = [None if t is None else t.index_select(0, c.nodes.flatten()).view(c.nodes.shape + t.shape[1:]) for t in padded]
        init = None
        if c.perm is not None:
            parts = [finals[src].index_select(0, idx) for src, idx in c.sources]
            init = torch.cat([torch.zeros_like(parts[0][:1])] + parts).index_select(0, c.perm)
        if c.hang is not None and c.hang_from is not None and starts is not None:
            state = starts()
            init = state.new_zeros((c.nodes.shape[0],) + state.shape[1:]) if init is None else init
            init = init.index_copy(0, c.hang, state.to(init.dtype).index_select(0, c.hang_from))
        out, final = call(*rows, init)
        finals.append(final)
        outs.append(out.flatten(0, 1))
    if not outs:
        return first.new_zeros((1, 0) + first.shape[2:]), finals, plan
    return torch.cat(outs).index_select(0, plan.owner)[None], finals, plan


def tree_chunk_rule(
    orig: Callable[..., Any],
    tree: Tree,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A delta rule (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``: q, k [1, N, H, K], v [1, N, H, V],
    g [1, N, H] or [1, N, H, K], beta [1, N, H]) on the tree: (out [1, N, H, V], None). ``chunk_size`` is passed on
    only when the layer passes it (FLA's kernels take none); the grid is 64 tokens otherwise, theirs and the
    reference's."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise TreepackError("E_ARG", f"{tree.layer}: a tree forward takes no cache, initial state or cu_seqlens", field="attention_mask")

    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size

    def call(q: Any, k: Any, v: Any, gg: Any, bb: Any, init: Any) -> Any:
        return orig(q, k, v, g=gg, beta=bb, initial_state=init, output_final_state=True, **kwargs)

    return _run(tree, chunk_size or 64, (query, key, value, g, beta), call), None


def tree_mamba2_scan(
    orig: Callable[..., Any],
    tree: Tree,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    z: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``mamba2_chunk_scan`` (x [1, N, H, P], dt [1, N, H], B, C [1, N, G, S]) on the tree: y [1, N, H, P].

    The step size is finished here, with the same operations the scan applies (bias, softplus, clamp), and passed on
    finished: a padding token then has dt = 0 and leaves the state unchanged, where the scan's clamp would give it
    the floor dt_limit[0] and decay the state."""
    if initial_states is not None or return_final_states or kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise TreepackError(
            "E_ARG", f"{tree.layer}: a tree forward takes no cache, initial state, seq_idx or cu_seqlens", field="attention_mask"
        )
    if dt.element_size() < 4 and not getattr(orig, "__module__", "").startswith("transformers."):
        dt = dt.float()  # as mamba-ssm's kernel finishes it (transformers' reference: in dt's own dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])

    def call(x: Any, d: Any, b: Any, c: Any, zz: Any, init: Any) -> Any:
        return orig(
            x,
            d,
            A,
            b,
            c,
            chunk_size=chunk_size,
            D=D,
            z=zz,
            dt_bias=None,
            initial_states=init,
            dt_softplus=False,
            dt_limit=(0.0, float("inf")),
            return_final_states=True,
            **kwargs,
        )

    return _run(tree, chunk_size, (hidden_states, dt, B, C, z), call)


def no_fused(orig: Callable[..., Any], tree: Tree, *args: Any, **kwargs: Any) -> None:
    """``mamba2_split_conv1d_scan_combined`` on a tree: None, which makes the layer take its split path (the
    convolution and the scan above); the fused kernel runs the packed row as one sequence."""
    return None


def dispatcher(kind: Callable[..., Any], orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig`` with the tree way ``kind`` while a prepared layer runs on a tree."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        tree = current.get()
        return orig(*args, **kwargs) if tree is None else kind(orig, tree, *args, **kwargs)

    dispatch.treepack_original = orig  # type: ignore[attr-defined]
    dispatch.__name__ = getattr(orig, "__name__", "dispatch")
    dispatch.__doc__ = getattr(orig, "__doc__", None)
    return dispatch
