"""``prepare(model)``: every token-mixing layer of a Hugging Face model tree-aware, or a TreepackError naming the one
that cannot be.

    >>> import treepack, treepack.torch
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> model = treepack.torch.prepare(model)                    # packed_logprobs calls it too; idempotent
    >>> batch = treepack.torch.load_microbatch(treepack.list_microbatches("packed")[0])
    >>> mask = treepack.torch.tree_mask(batch)
    >>> model(batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask).logits.shape
    torch.Size([1, 10, 64])

Softmax attention takes the tree through the ``"treepack"`` attention function. The recurrent layers listed in
``LAYERS`` (Gated DeltaNet, Kimi Delta Attention, Mamba2) run the tree way (python/treepack/torch/recurrent.py) when
they receive a TreeMask: ``prepare`` puts a dispatcher in front of the convolution and recurrence functions of their
modeling module and wraps each layer's forward, and a hook on the base model hands the TreeMask to every layer (as
the per-layer-type mask dict HF models accept) and turns the cache off (a tree has no single continuation).

``chunk_align`` (default False): False runs each radix segment once from its parent's final state, the least work,
exact in exact arithmetic, and equal to the unpacked run up to the rounding of the recurrence's float32 (about 1e-6
relative; 1e-12 in float64). True re-runs, in every branch's row, the parent's tokens since the last chunk boundary
(at most chunk size - 1 per segment), so every row sees the unpacked run's chunk grid: Gated DeltaNet and KDA then
give the unpacked run's outputs bit for bit (Mamba2's scan combines chunk states all at once, so it stays at the
rounding level).

Any other module that mixes tokens (a convolution over the sequence, a Mamba1 / lightning / short-conv layer, an
attention module that does not go through the attention interface) is refused here, by class and layer index.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any, Callable

import torch

from ..microbatch import TreepackError
from ..versions import require
from . import recurrent
from .attention import TreeMask

# Layer class -> the modeling-module functions its forward calls and how each runs on a tree.
_GDN: dict[str, Callable[..., Any]] = {"causal_conv1d_fn": recurrent.tree_conv, "torch_chunk_gated_delta_rule": recurrent.tree_chunk_rule}
_KDA: dict[str, Callable[..., Any]] = {"causal_conv1d_fn": recurrent.tree_conv, "chunk_kimi_delta_attention": recurrent.tree_chunk_rule}
_MAMBA2: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn": recurrent.tree_conv,
    "mamba2_chunk_scan": recurrent.tree_mamba2_scan,
    "mamba2_split_conv1d_scan_combined": recurrent.no_fused,
}
LAYERS: dict[str, dict[str, Callable[..., Any]]] = {
    "Qwen3_5GatedDeltaNet": _GDN,
    "Qwen3_5MoeGatedDeltaNet": _GDN,
    "Qwen3NextGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA,
    "NemotronHMamba2Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "FalconH1Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
}

# Names of modules that mix tokens without the attention interface; a Conv1d over the sequence is caught by type.
_MIXER_NAME = re.compile(
    r"mamba|mixer|deltanet|delta_?attention|linear_?attention|lightning|shortconv|short_conv|ssm|rwkv|retention|hyena|recurren", re.I
)
# ... unless the name says it works per token (a family's norms, embeddings and MLPs carry the family's name).
_TOKENWISE_NAME = re.compile(r"norm|embedding|mlp|rotary", re.I)


class _TreeMasks(dict[str, Any]):
    """The per-layer-type mask dict HF models accept in place of a mask: the TreeMask for every layer type (the
    mask builders would return a 4-D BlockMask unchanged anyway; the recurrent one cannot read it)."""

    def __init__(self, mask: TreeMask):
        super().__init__()
        self.mask = mask

    def __missing__(self, key: str) -> TreeMask:
        return self.mask

    def get(self, key: str, default: Any = None) -> TreeMask:
        return self.mask

    def __contains__(self, key: object) -> bool:
        return True


def _tree_of(value: Any) -> TreeMask | None:
    if isinstance(value, TreeMask):
        return value
    if isinstance(value, _TreeMasks):
        return value.mask
    return None


def _base_pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, TreeMask):
        if any(isinstance(a, TreeMask) for a in args):
            raise TreepackError("E_ARG", "pass the TreeMask as attention_mask=... (by keyword)", field="attention_mask")
        return None
    if kwargs.get("past_key_values") is not None:
        raise TreepackError(
            "E_ARG", "a tree forward takes no past_key_values (a forest has no single continuation)", field="past_key_values"
        )
    kwargs = dict(kwargs, attention_mask=_TreeMasks(mask), use_cache=False)
    return args, kwargs


def _ensure_dispatch(module_globals: dict[str, Any], kinds: dict[str, Callable[..., Any]]) -> None:
    """Puts the dispatchers in front of the named functions (again, if something rebound a name since)."""
    for name, kind in kinds.items():
        fn = module_globals.get(name)
        if fn is None:
            raise TreepackError(
                "E_ARG",
                f"{module_globals.get('__name__')} has no function {name}: this transformers version is not supported",
                field="model",
            )
        if getattr(fn, "treepack_kind", None) is not kind:
            d = recurrent.dispatcher(kind, fn)
            d.treepack_kind = kind  # type: ignore[attr-defined]
            module_globals[name] = d


_TREE_CLASSES: dict[type, type] = {}


def _registered(cls: type) -> type | None:
    """The transformers layer class in ``LAYERS`` that ``cls`` is or derives from (a wrapper's subclass, FSDP2's)."""
    return next((c for c in cls.__mro__ if c.__name__ in LAYERS and c.__module__.startswith("transformers.")), None)


def _tree_class(cls: type[torch.nn.Module]) -> type:
    """A subclass of the layer class (same name and module) whose forward runs the tree way on a TreeMask; a class
    rather than a wrapped instance forward, so copies of a prepared model (copy.deepcopy) stay prepared."""
    sub = _TREE_CLASSES.get(cls)
    if sub is not None:
        return sub
    base = _registered(cls)
    if base is None:
        raise TreepackError("E_ARG", f"{cls.__name__} is not a layer treepack runs on a tree", field="model")
    kinds = LAYERS[base.__name__]
    module_globals = sys.modules[base.__module__].__dict__  # where its forward looks the functions up

    # self: the layer, a transformers module that prepare() gave treepack_name and treepack_chunk_align.
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = _tree_of(kwargs.get("attention_mask"))
        if mask is None:
            if any(_tree_of(a) is not None for a in args):
                raise TreepackError(
                    "E_ARG", f"{self.treepack_name}: pass the tree as attention_mask=... (by keyword)", field="attention_mask"
                )
            return cls.forward(self, *args, **kwargs)
        if kwargs.get("cache_params") is not None:
            raise TreepackError("E_ARG", f"{self.treepack_name}: a tree forward takes no cache", field="cache_params")
        _ensure_dispatch(module_globals, kinds)
        token = recurrent.current.set(recurrent.Tree(mask, self.treepack_chunk_align, self.treepack_name))
        try:
            return cls.forward(self, *args, **dict(kwargs, attention_mask=None))
        finally:
            recurrent.current.reset(token)

    sub = _TREE_CLASSES[cls] = type(
        cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__, "treepack_base": cls}
    )
    return sub


@functools.cache
def _uses_attention_interface(cls: type[torch.nn.Module]) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src or "attention_interface" in src


def layer_index(path: str) -> str:
    """The decoder-layer index in a module path ("model.layers.3.linear_attn" -> "3"; "?" when none)."""
    m = re.search(r"\.(\d+)(\.|$)", path)
    return m.group(1) if m else "?"


def token_mixers(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], list[tuple[str, torch.nn.Module]]]:
    """(recurrent layers treepack runs on a tree, token-mixing modules it does not handle), as (path, module). A
    module looks like a token mixer by type (a Conv1d over the sequence), by name, or as an attention module that
    bypasses the attention interface; one that holds a handled layer (a decoder layer named after its mixer) is not."""
    modules = list(model.named_modules())
    handled = [(p, m) for p, m in modules if _registered(type(m)) is not None]
    # The ignore: classes are hashable, but mypy does not match type[Any] to functools.cache's Hashable.
    covered = [p for p, _ in handled] + [
        p
        for p, m in modules
        if type(m).__name__.endswith("Attention") and _uses_attention_interface(type(m))  # type: ignore[arg-type]
    ]

    def within(p: str, q: str) -> bool:
        """Whether module p is inside module q ("" is the model)."""
        return p != q and (q == "" or p.startswith(q + "."))

    other = []
    for path, m in modules:
        cls = type(m).__name__
        if any(path == c or within(path, c) or within(c, path) for c in covered):  # handled, or holds / is inside one
            continue
        if (isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1) or _named_mixer(cls):
            other.append((path, m))
    # Named first, the innermost of them first (a Mamba1 mixer, not the decoder layer named after it); then convolutions.
    named = [p for p, m in other if _named_mixer(type(m).__name__)]
    other.sort(key=lambda pm: (pm[0] not in named, sum(within(q, pm[0]) for q in named)))
    return handled, other


def unsupported_mixers(model: torch.nn.Module, supported: frozenset[str]) -> list[tuple[str, torch.nn.Module]]:
    """The token mixers of ``model`` (``token_mixers``) a caller cannot run: every unhandled one, and the handled
    recurrent layers whose class (``treepack_base`` for a prepared one) is not in ``supported``; as (path, module)."""
    handled, other = token_mixers(model)
    return other + [(p, m) for p, m in handled if getattr(type(m), "treepack_base", type(m)).__name__ not in supported]


def _named_mixer(cls: str) -> bool:
    return (bool(_MIXER_NAME.search(cls)) or cls.endswith("Attention")) and not _TOKENWISE_NAME.search(cls)


def _refuse(other: list[tuple[str, torch.nn.Module]], why: str) -> None:
    path, m = other[0]
    more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
    raise TreepackError("E_ARG", f"layer {layer_index(path)} ({path}): {type(m).__name__} mixes tokens and {why}{more}", field="model")


def refuse_non_attention(model: torch.nn.Module, why: str) -> None:
    """Refuses (TreepackError naming the first layer) a model with any token-mixing layer other than softmax attention,
    saying ``why`` a path that reaches attention only cannot run it."""
    handled, other = token_mixers(model)
    if handled or other:
        _refuse(handled + other, why)


def check_dense(model: torch.nn.Module) -> None:
    """For the dense-mask (sdpa/eager) path: refuses a model with any token-mixing layer other than attention."""
    refuse_non_attention(model, "the dense 4-D mask reaches only attention; load the model with attn_implementation='treepack'")


def prepare(model: torch.nn.Module, chunk_align: bool | None = None) -> torch.nn.Module:
    """Makes every token-mixing layer of ``model`` (a HF causal LM or base model) run on the TreeMask it is given
    (module docstring); returns the model. ``chunk_align`` None keeps a prepared layer's setting (False the first
    time). Raises TreepackError naming the first layer treepack cannot run.

        >>> from transformers import AutoModelForCausalLM
        >>> model = prepare(AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack"), chunk_align=True)
        >>> prepare(model, chunk_align="yes")
        Traceback (most recent call last):
        treepack.errors.TreepackError: field "chunk_align": expected True, False or None, got 'yes'
    """
    if chunk_align is not None and not isinstance(chunk_align, bool):
        raise TreepackError("E_ARG", f"expected True, False or None, got {chunk_align!r}", field="chunk_align")
    require("transformers")  # the modeling modules' function names and forwards it patches are those releases'
    handled, other = token_mixers(model)
    if other:
        _refuse(other, "treepack cannot run it on a tree (supported recurrent layers: " + ", ".join(sorted(LAYERS)) + ")")
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    if handled and not getattr(base, "treepack_prepared", False):
        base.register_forward_pre_hook(_base_pre_hook, with_kwargs=True)
        base.treepack_prepared = True
    for path, module in handled:
        layer: Any = module  # prepare() gives it treepack_* attributes (torch types a Module's as Tensor | Module)
        base_cls = _registered(type(layer))
        if base_cls is None:  # handled holds registered layers only
            continue
        _ensure_dispatch(sys.modules[base_cls.__module__].__dict__, LAYERS[base_cls.__name__])
        if not hasattr(type(layer), "treepack_base"):
            layer.__class__ = _tree_class(type(layer))
            layer.treepack_name = f"layer {layer_index(path)} ({type(layer).__name__})"
            layer.treepack_chunk_align = bool(chunk_align)
        elif chunk_align is not None:
            layer.treepack_chunk_align = chunk_align
    return model


def refuse_unsupported(model: torch.nn.Module, supported: frozenset[str], why: str) -> None:
    """Refuses (TreepackError naming the first layer) a model with a token mixer a caller cannot run
    (``unsupported_mixers``), saying ``why``."""
    bad = unsupported_mixers(model, supported)
    if bad:
        _refuse(bad, why)


def check_context_parallel(model: torch.nn.Module) -> None:
    """Refuses (TreepackError) a model with a token mixer whose state context parallelism does not carry over a rank
    boundary: any mixer treepack does not run on a tree (the recurrent layers it does, ``LAYERS``, pass their states
    across ranks)."""
    refuse_unsupported(
        model,
        frozenset(LAYERS),
        "its state is not passed across context-parallel ranks (attention and " + ", ".join(sorted(LAYERS)) + " are): "
        "run this row on one rank",
    )
