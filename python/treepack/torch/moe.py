"""Mixture-of-experts models on packed trees: routing replay (the forward uses the experts the inference engine
chose) and the router's load-balancing loss counted per logical occurrence.

    >>> import torch, treepack.torch as tpt
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2)
    >>> model = Qwen3MoeForCausalLM(cfg).eval()
    >>> ids = torch.tensor([[5, 6, 7]])
    >>> routes = torch.tensor([[[0, 1]] * 3, [[2, 3]] * 3])    # [MoE layers, tokens, k]: what the engine chose
    >>> with tpt.replay_routes(model, routes) as routing:
    ...     logits = model(ids).logits                        # every MoE layer uses the given experts
    >>> routing.experts().tolist() == routes.tolist(), len(routing.logits)
    (True, 2)
    >>> tpt.load_balancing_loss(routing).dtype             # the router's aux loss (transformers' formula), float64
    torch.float64

Replay (R3, as Megatron's and verl's router replay define it): a replayed layer routes token t to the stored experts
``routes[l, t]`` instead of its own top-k, and weights them with its own probabilities at those experts, normalised as
the model does (Qwen3-MoE: softmax over all experts, gathered, renormalised when ``norm_topk_prob``; Qwen3.5-MoE:
the same, always renormalised; gpt-oss: softmax
over the gathered logits; DeepSeek-V3: sigmoid scores, gathered, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``), so gradients flow into the router's weights through those probabilities. The router's
probabilities are computed in float32 as transformers does, or float64 for a float64 model (where transformers' float32
would cost exactness, as ``packed_logprobs``' logits). ``ROUTERS`` lists the router classes handled (each family's
classes share one ``forward`` text, which a test checks); a model with any other router, or routes of the wrong
shape, dtype or expert range (or a token given one expert twice), is refused with a TreepackError naming the layer,
never a silent top-k.

Load-balancing loss: transformers' (Switch Transformer's) ``E * sum_e f_e * P_e`` over all layers' tokens, with
``f_e`` the share of routed slots that went to expert e and ``P_e`` its mean probability. On a tree a shared node
stands for every sequence that contains it, so ``load_balancing_loss(routing, batch)`` weighs node p by the number of
occurrences mapped to it: the value and gradient of the unpacked batch's loss (each sequence its own row, padding
masked). With replay, ``f_e`` counts the replayed experts (the ones the forward used).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..microbatch import TreepackError
from .models import layer_index
from .wrappers import unwrap

# Router class -> how its forward weighs the experts it picks (see the module docstring); each family is the classes
# whose forward is its first class's, character for character.
_SOFTMAX = (
    "Qwen3MoeTopKRouter",
    "Qwen2MoeTopKRouter",
    "Qwen3NextTopKRouter",
    "OlmoeTopKRouter",
    "FlexOlmoTopKRouter",
    "MellumTopKRouter",
    "Qwen3OmniMoeThinkerTextTopKRouter",
    "Qwen3OmniMoeTalkerTextTopKRouter",
    "Qwen4ExpTextTopKRouter",
)
_SIGMOID = (
    "DeepseekV3TopkRouter",
    "DeepseekV32TopkRouter",
    "AXK1TopkRouter",
    "Dots1TopkRouter",
    "ExaoneMoeTopkRouter",
    "Glm4MoeTopkRouter",
    "Glm4MoeLiteTopkRouter",
    "Glm4vMoeTextTopkRouter",
    "Glm5NextTextTopkRouter",
    "GlmMoeDsaTopkRouter",
    "HYV4TopkRouter",
    "KimiLinearTopkRouter",
    "MiMoV2FlashTopkRouter",
    "NemotronHTopkRouter",
    "SolarOpenTopkRouter",
)
_RENORMALISED = ("Qwen3_5MoeTopKRouter", "Qwen3OmniMoeTextTopKRouter", "Qwen3VLMoeTextTopKRouter")
ROUTERS: dict[str, str] = {
    **{n: "softmax" for n in _SOFTMAX},
    **{n: "softmax-renormalised" for n in _RENORMALISED},
    "GptOssTopKRouter": "topk-softmax",
    **{n: "sigmoid" for n in _SIGMOID},
}

# A module is a router by its class name, or as a Linear named gate/router inside a mixture-of-experts block.
_ROUTER_NAME = re.compile(r"(Router|Gating|Gate)$")
_NOT_ROUTER = re.compile(r"Forget|Norm|MLP|Proj", re.I)
_MOE_BLOCK = re.compile(r"moe|expert|sparse", re.I)


# A transformers router module: its attributes differ per class (weight, bias, top_k, num_experts, norm_topk_prob,
# hidden_dim, routed_scaling_factor) and prepare_routers adds treepack_name and treepack_kind, so it is typed loosely.
Router = Any


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softmax(router: Router, h: torch.Tensor, experts: torch.Tensor, renormalise: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h.reshape(-1, router.hidden_dim), router.weight)
    w = torch.softmax(logits, dim=-1, dtype=_wide(logits.dtype)).gather(1, experts)
    if router.norm_topk_prob if renormalise is None else renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(logits.dtype)


def _softmax_renormalised(router: Router, h: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _softmax(router, h, experts, renormalise=True)


def _topk_softmax(router: Router, h: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h, router.weight, router.bias)
    picked = logits.gather(1, experts)
    return logits, torch.softmax(picked, dim=1, dtype=picked.dtype)


def _sigmoid(router: Router, h: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = _wide(h.dtype)
    logits = F.linear(h.view(-1, router.hidden_dim).to(dtype), router.weight.to(dtype))
    w = logits.sigmoid().gather(1, experts)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, w * router.routed_scaling_factor


_REPLAY = {"softmax": _softmax, "softmax-renormalised": _softmax_renormalised, "topk-softmax": _topk_softmax, "sigmoid": _sigmoid}


class Routing:
    """One forward's routing, filled in by the routers while ``replay_routes`` is open: ``logits`` (per MoE layer, in
    model order, the router's logits [tokens, experts]) and the experts each layer used (``experts()``)."""

    def __init__(self, routes: torch.Tensor | None, routers: list[Router]):
        self.routes = routes
        self.routers = routers
        self._logits: list[torch.Tensor | None] = [None] * len(routers)
        self._experts: list[torch.Tensor | None] = [None] * len(routers)

    @property
    def logits(self) -> tuple[torch.Tensor, ...]:
        """The router logits [tokens, experts] of every MoE layer (differentiable); refused before the forward ran."""
        missing = [i for i, x in enumerate(self._logits) if x is None]
        if missing:
            raise TreepackError("E_ARG", f"{self.routers[missing[0]].treepack_name} did not run inside replay_routes", field="routing")
        return tuple(self._logits)  # type: ignore[arg-type]

    def experts(self) -> torch.Tensor:
        """int64 [MoE layers, tokens, k]: the experts each layer used (the replayed ones, or its own top-k)."""
        self.logits  # noqa: B018  (the check that every layer ran)
        return torch.stack(self._experts)  # type: ignore[arg-type]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each MoE layer's router kind (``ROUTERS``)."""
        return tuple(r.treepack_kind for r in self.routers)

    def _record(self, index: int, logits: torch.Tensor, experts: torch.Tensor) -> None:
        if self._logits[index] is not None:
            raise TreepackError(
                "E_ARG",
                f"{self.routers[index].treepack_name} ran twice inside one replay_routes (one forward per context)",
                field="routing",
            )
        self._logits[index], self._experts[index] = logits, experts


_current: contextvars.ContextVar[Routing | None] = contextvars.ContextVar("treepack_routing", default=None)
_REPLAY_CLASSES: dict[type, type] = {}


def _handled(cls: type) -> type | None:
    """The transformers router class in ``ROUTERS`` that ``cls`` is or derives from (an FSDP2 subclass, ours)."""
    return next((c for c in cls.__mro__ if c.__name__ in ROUTERS and c.__module__.startswith("transformers.")), None)


def _replay_class(cls: type[torch.nn.Module]) -> type:
    """A subclass of the router class (same name and module) that replays or records inside ``replay_routes`` and is
    the stock router outside it; a class, so copies of the model stay prepared."""
    sub = _REPLAY_CLASSES.get(cls)
    if sub is not None:
        return sub
    base = _handled(cls)
    if base is None:
        raise TreepackError("E_ARG", f"{cls.__name__} is not a router treepack can replay (ROUTERS)", field="routes")
    kind = ROUTERS[base.__name__]

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> Any:
        routing = _current.get()
        if routing is None or self not in routing.routers:
            return cls.forward(self, hidden_states)
        i = routing.routers.index(self)
        if routing.routes is None:
            out = cls.forward(self, hidden_states)
            routing._record(i, out[0], out[2])
            return out
        experts = routing.routes[i]
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if experts.shape[0] != tokens:
            raise TreepackError(
                "E_INPUT", f"{self.treepack_name}: routes[{i}] has {experts.shape[0]} tokens but the forward has {tokens}", field="routes"
            )
        unrouted = experts[:, 0] < 0  # check_routes: a token's row is all -1 or all experts
        if bool(unrouted.any()):
            # A token the engine did not route (vLLM's last; a node of an unrouted sequence) takes the router's own
            # top-k, as the unpacked forward would.
            own = cls.forward(self, hidden_states)[2].to(experts.dtype)
            experts = torch.where(unrouted[:, None], own, experts)
        logits, weights = _REPLAY[kind](self, hidden_states, experts)
        routing._record(i, logits, experts)
        return logits, weights, experts

    sub = _REPLAY_CLASSES[cls] = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "treepack_router_base": cls,
            "treepack_kind": kind,
        },
    )
    return sub


def routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The (path, module) of every MoE router of ``model``, in model order; a router treepack does not replay is
    refused (TreepackError naming its layer)."""
    named = dict(model.named_modules())
    out = []
    for path, m in named.items():
        cls = type(m).__name__
        parent = named.get(path.rpartition(".")[0]) if "." in path else None
        linear_gate = (
            isinstance(m, torch.nn.Linear)
            and path.rpartition(".")[2] in ("gate", "router")
            and parent is not None
            and bool(_MOE_BLOCK.search(type(parent).__name__))
        )
        if not (linear_gate or (_ROUTER_NAME.search(cls) and not _NOT_ROUTER.search(cls))):
            continue
        if _handled(type(m)) is None:
            raise TreepackError(
                "E_ARG",
                f"layer {layer_index(path)} ({path}): treepack cannot replay the routes of {cls} (supported routers: "
                "Qwen3-MoE's, gpt-oss's, DeepSeek-V3's and those sharing their code: treepack.torch.moe.ROUTERS)",
                field="model",
            )
        out.append((path, m))
    return out


def prepare_routers(model: torch.nn.Module) -> list[Router]:
    """Makes every router of ``model`` (a Hugging Face model, unwrapped) able to replay (idempotent); returns them in
    model order. TreepackError naming the layer for a router treepack cannot replay, or a model without routers."""
    found: list[tuple[str, Router]] = routers(model)
    if not found:
        raise TreepackError(
            "E_ARG", f"{type(model).__name__} has no mixture-of-experts router: there is nothing to replay or record", field="routes"
        )
    for path, m in found:
        if not hasattr(type(m), "treepack_router_base"):
            m.__class__ = _replay_class(type(m))
        m.treepack_name = f"layer {layer_index(path)} ({type(m).__name__})"
    return [m for _, m in found]


def check_routes(routes: Any, layers: list[Router], tokens: int | None = None) -> torch.Tensor:
    """``routes`` as int64 [MoE layers, tokens, k], after checking them against the routers (shape, each layer's
    top-k and expert range, no expert twice for a token): TreepackError(E_INPUT, field "routes") naming the layer."""
    if not isinstance(routes, torch.Tensor) or routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        got = f"{routes.dtype} tensor" if isinstance(routes, torch.Tensor) else type(routes).__name__
        raise TreepackError("E_INPUT", f"expected an integer tensor [MoE layers, tokens, k], got a {got}", field="routes")
    shape = list(routes.shape)
    if routes.dim() != 3 or shape[0] != len(layers) or (tokens is not None and shape[1] != tokens):
        want = f"[{len(layers)}, {'tokens' if tokens is None else tokens}, k]"
        raise TreepackError(
            "E_INPUT", f"expected routes of shape {want} (one [tokens, k] per MoE layer, in model order), got {shape}", field="routes"
        )
    routes = routes.long()
    for i, r in enumerate(layers):
        if shape[2] != r.top_k:
            raise TreepackError(
                "E_INPUT", f"{r.treepack_name}: routes[{i}] give {shape[2]} experts per token, the router picks {r.top_k}", field="routes"
            )
        routed = routes[i][~(routes[i] == -1).all(dim=-1)]  # a row of -1: unrouted, the router's own top-k
        if routed.numel():
            lo, hi = int(routed.min()), int(routed.max())
            if lo < 0 or hi >= r.num_experts:
                raise TreepackError(
                    "E_INPUT",
                    f"{r.treepack_name}: routes[{i}] hold expert {lo if lo < 0 else hi}, outside [0, {r.num_experts})",
                    field="routes",
                )
            s = routes[i].sort(dim=-1).values
            twice = (s[:, 1:] == s[:, :-1]).any(dim=-1) & (s[:, -1] >= 0)
            if bool(twice.any()):
                raise TreepackError(
                    "E_INPUT", f"{r.treepack_name}: routes[{i}] give token {int(twice.nonzero()[0])} the same expert twice", field="routes"
                )
    checked: torch.Tensor = routes
    return checked


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor | None = None, tokens: int | None = None) -> Iterator[Routing]:
    """Within the block, one forward of ``model`` (any wrapper: the routers run inside it) routes token t of MoE
    layer l to ``routes[l, t]`` (int [MoE layers, tokens, k], tokens in the order of the forward's flattened input,
    batch by sequence; a token whose row is all -1, one the engine did not route, takes the router's own top-k), or,
    with ``routes=None``, every token to the router's own top-k; either way the yielded ``Routing``
    records each layer's logits and experts. ``tokens``: the forward's token count, checked up front when known.
    Refused under gradient checkpointing when replaying (the recomputation in backward runs outside the block)."""
    hf = unwrap(model)
    layers = prepare_routers(hf)
    if routes is not None:
        if getattr(hf, "is_gradient_checkpointing", False) and torch.is_grad_enabled():
            raise TreepackError(
                "E_ARG",
                "routes cannot be replayed under gradient checkpointing: its recomputation runs the routers again "
                "outside the replay (model.gradient_checkpointing_disable())",
                field="gradient_checkpointing",
            )
        device = layers[0].weight.device
        routes = check_routes(routes, layers, tokens).to(device)
    routing = Routing(routes, layers)
    token = _current.set(routing)
    try:
        yield routing
    finally:
        _current.reset(token)


class RouterOutputs(NamedTuple):
    """A packed forward's routing, for ``load_balancing_loss``: the router ``logits`` per MoE layer ([N, experts]),
    the ``experts`` used (int64 [MoE layers, N, k]), each layer's ``kinds`` and the model's ``aux_coef``
    (``router_aux_loss_coef``, None when the model has no load-balancing loss)."""

    logits: tuple[torch.Tensor, ...]
    experts: torch.Tensor
    kinds: tuple[str, ...]
    aux_coef: float | None


def router_outputs(routing: Routing, model: torch.nn.Module) -> RouterOutputs:
    """The ``RouterOutputs`` of a finished ``replay_routes`` block over ``model``."""
    cfg: Any = unwrap(model).config  # a transformers PretrainedConfig
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    coef = getattr(cfg, "router_aux_loss_coef", None)
    return RouterOutputs(routing.logits, routing.experts(), routing.kinds, None if coef is None else float(coef))


def occurrence_weights(batch: Any, num_nodes: int | None = None) -> torch.Tensor:
    """float64 [N]: how many (sequence, token) occurrences map to each node (0 at padding): what a node counts for in
    a per-token sum over the unpacked batch. ``batch``: a PackedBatch or a mapping with ``seq_positions``."""
    pos = batch["seq_positions"] if isinstance(batch, Mapping) else batch.seq_positions
    n = batch.num_nodes if num_nodes is None else num_nodes
    if pos.numel() and int(pos.max()) >= n:
        raise TreepackError(
            "E_INPUT", f"seq_positions holds {int(pos.max())}, outside the N = {n} nodes the router saw", field="seq_positions"
        )
    return torch.bincount(pos.long(), minlength=n).to(torch.float64)


def load_balancing_loss(routing: Any, batch: Any = None) -> torch.Tensor:
    """The router's load-balancing loss (transformers' ``load_balancing_loss_func``: ``E * sum_e f_e * P_e`` over
    every MoE layer's tokens) of the batch's sequences as an unpacked batch counts them: node p weighs the number of
    occurrences mapped to it (``occurrence_weights``; every token 1 when ``batch`` is None). ``routing``: a
    ``Routing`` or ``RouterOutputs``; ``f_e`` counts the experts the forward used (the replayed ones). A float64 0-d
    tensor, differentiable through the router logits. Refused for sigmoid routers (DeepSeek-V3 and its family
    balance without an auxiliary loss in transformers).

    On a rank's local part of a context-parallel row (``treepack.torch.split_batch``; the router saw its local nodes),
    the experts' counts and the occurrences they are normalised by are all-reduced over the group, and the value is
    this rank's share of the row's loss (it is linear in the local probabilities once those are global): the ranks'
    values sum to the one-rank loss, and their gradients too (``reduce_gradients``)."""
    logits = routing.logits
    experts = routing.experts() if isinstance(routing, Routing) else routing.experts
    if any(k == "sigmoid" for k in routing.kinds):
        raise TreepackError(
            "E_ARG",
            "sigmoid routers (DeepSeek-V3's family) have no load-balancing loss in transformers "
            "(they balance with e_score_correction_bias)",
            field="aux_loss",
        )
    dev = logits[0].device
    n = logits[0].shape[0]
    part = getattr(batch, "context_parallel", None)
    if batch is None:
        w = torch.ones(n, dtype=torch.float64, device=dev)
    elif part is not None:  # the context's nodes (the first A) are routed on the ranks that own them
        w = occurrence_weights(batch, part.rows + n)[part.rows :].to(dev)
    else:
        w = occurrence_weights(batch, n).to(dev)
    E = logits[0].shape[-1]
    count = torch.zeros(E, dtype=torch.float64, device=dev)
    prob = torch.zeros(E, dtype=torch.float64, device=dev)
    for layer_logits, used in zip(logits, experts):
        p = torch.softmax(layer_logits.to(torch.float64), dim=-1)
        count = count.index_add(0, used.reshape(-1).to(dev), w.repeat_interleave(used.shape[-1]))
        prob = prob + (p * w[:, None]).sum(0)
    total = w.sum() * len(logits)
    if part is not None:  # f_e and the normalisation are the row's; P_e's sum stays local (the share's gradient)
        both = part.all_reduce(torch.cat([count, total[None]]), "the load-balancing loss's expert counts")
        count, total = both[:-1], both[-1]
    aux: torch.Tensor = E * torch.sum((count / total) * (prob / total))
    return aux


def pack_routed(sequences: Any, routes: Any, **pack_kwargs: Any) -> tuple[Any, torch.Tensor]:
    """(``pack_sequences`` micro-batch, int64 routes [MoE layers, N, k]) of ``sequences`` whose token t was routed to
    ``routes[i][l, t]`` (per sequence an int array [MoE layers, len, k]): tokens are shared only where their routes
    agree too, so where two sequences' routes of a shared prefix differ the tree splits there and every sequence
    replays exactly its own routes. ``pack_kwargs`` go to ``pack_sequences``.

        >>> mb, r = pack_routed([[5, 6, 7], [5, 6, 8]], [[[[0], [1], [2]]], [[[0], [3], [2]]]])   # token 6: experts 1 vs 3
        >>> mb.input_ids.tolist(), r[0, :, 0].tolist()                                        # one shared node (5), then split
        ([5, 6, 7, 6, 8], [0, 1, 2, 3, 2])
    """
    import numpy as np

    from ..pack import pack_sequences

    if len(routes) != len(sequences):
        raise TreepackError("E_ARG", f"{len(routes)} route arrays for {len(sequences)} sequences", field="routes")
    keys: dict[tuple[int, bytes], int] = {}
    table: list[tuple[int, np.ndarray]] = []
    composite = []
    for i, (seq, r) in enumerate(zip(sequences, routes)):
        r = np.asarray(r, dtype=np.int64)
        if r.ndim != 3 or r.shape[1] != len(seq) or (table and r.shape[::2] != table[0][1].shape):
            raise TreepackError(
                "E_INPUT",
                f"sequence {i}: expected routes [MoE layers, {len(seq)}, k] like the others', got {list(r.shape)}",
                field="routes",
            )
        ids = []
        for t, tok in enumerate(seq):
            step = np.ascontiguousarray(r[:, t])
            key = (int(tok), step.tobytes())
            if key not in keys:
                keys[key] = len(table)
                table.append((int(tok), step))
            ids.append(keys[key])
        composite.append(ids)
    mb = pack_sequences(composite, **pack_kwargs)
    nodes = mb.input_ids.astype(np.int64)
    mb.input_ids = np.array([table[c][0] for c in nodes], dtype=mb.input_ids.dtype)
    packed = np.stack([table[c][1] for c in nodes], axis=1) if len(nodes) else np.zeros((0, 0, 0), dtype=np.int64)
    return mb, torch.from_numpy(packed)


__all__ = [
    "ROUTERS",
    "Routing",
    "RouterOutputs",
    "check_routes",
    "load_balancing_loss",
    "occurrence_weights",
    "pack_routed",
    "prepare_routers",
    "replay_routes",
    "router_outputs",
    "routers",
]
