"""Executing a step plan: micro-batches of one rank that hang from a prefix computed once (docs/concepts/micro-batching.md, "Step plans").

A planned micro-batch is an ordinary packed micro-batch whose first ``prefix_tokens`` nodes are a chain (node p's
parent is p - 1): its root path, held by this rank as cached per-layer keys/values. Before it runs, the segments
``prefix_push`` lists (ascending end depths, from the current stack depth) are pushed: run without grad on the
micro-batch's own chain nodes, their keys/values, final hidden states and node logprobs kept as leaves that gather
gradients. The micro-batch then computes only nodes ``[prefix_tokens, N)``: each query sees the cached keys that
are its ancestors plus its own tree ancestors (the tree rule over the whole forest), its first tokens are predicted
from the cached hidden state of their parent, and the logprobs of the chain's own nodes come from the cache. After
it, ``prefix_release`` segments are popped, top first: each is recomputed with grad against the segments below it
and back-propagated with the gradients its leaves gathered, which flow on into the parameters and the segments
below. The loss is one ``loss_fn`` call per micro-batch, so parameter gradients accumulate as in ordinary gradient
accumulation, and equal those of running every micro-batch in full.

    >>> import torch, treepack, treepack.torch as tpt
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> optimizer, cfg = torch.optim.SGD(model.parameters(), lr=0.1), {"clip_low": 0.2, "clip_high": 0.28}
    >>> rank_files = treepack.list_microbatches("planned")              # --prefix-reuse: both hang from [2, 3]
    >>> batches = [tpt.load_microbatch(p) for p in rank_files]          # in the plan's order on this rank
    >>> result = run_step_plan(model, batches, lambda lp, b: tpt.packed_loss(lp, b, cfg)[0])
    >>> result.computed_tokens, result.pushed_tokens                    # [2, 3] pushed once, recomputed at its pop
    (16, 2)
    >>> planned = [p.grad.clone() for p in model.parameters()]
    >>> model.zero_grad()
    >>> for b in batches:                                               # each micro-batch in full: the same gradients
    ...     tpt.packed_loss(tpt.packed_logprobs(model, b).logprobs, b, cfg)[0].backward()
    >>> all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(planned, model.parameters()))
    True
    >>> optimizer.step()

Sliding windows and sinks work unchanged: the cached keys take their place in the full forest's mask. A recurrent
layer (Gated DeltaNet, KDA, Mamba2: ``RECURRENT``) caches per segment, instead of keys/values, its last K-1
convolution inputs and its recurrent state after the segment's last node (O(1) in the segment's length); a
micro-batch's roots that continue the cached chain start from that state, their convolution windows reaching into
the cached inputs (python/treepack/torch/recurrent.py), and a pop back-propagates the gathered gradients of both
(the state's is the recurrence's ``dht``). Every computed node whose parent is cached must then hang from the
chain's last node (the planner's cuts guarantee it). Other token mixers are refused by name.

A mixture-of-experts model replays each node's routes (``batch.routes``) in every pass that computes it. With
``router=True`` a segment also keeps its router logits per MoE layer as leaves, so a micro-batch's ``router``
(``RouterOutputs`` of all its nodes, the cached ones' included) gives the load-balancing loss of the micro-batch as
it would be run in full (``load_balancing_loss``), value and gradient: the cached logits' gradient is carried into
the pop like the keys'.

A vision-language model (``treepack.torch.vision``) runs its vision encoder, in each pass, on the images that fill a
node of what that pass computes: an image whose fill lies in a cached prefix is encoded without grad when pushed
and again, with grad, when popped, so its gradient reaches the vision tower through the gathered leaves. A cached
prefix matches a micro-batch's only when its tokens and its images (hash and placeholder, node by node) do.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, cast

import torch

from ..microbatch import TreepackError
from .attention import tree_mask
from .batch import PackedBatch
from .cp_plan import CPPlan, make_groups
from .logprobs import NodeScores, _head_and_base, check_vocabulary, packed_logprobs, scored_nodes
from .models import layer_index, prepare, refuse_unsupported, token_mixers
from .moe import RouterOutputs, Routing, replay_routes, router_outputs
from .shared_prefix import GroupPrefix, Piece, Share, group_of, plan_shares
from .vision import has_images, hidden_states, image_keys, vision_family
from .wrappers import wrappers

# config.layer_types whose layers mix tokens by softmax attention only (or not at all).
_ATTENTION_TYPES = ("full_attention", "hybrid", "sliding_attention", "hybrid_sliding", "mlp")
# Recurrent layer classes whose prefix state (convolution tail, recurrent state) the executor carries; tested in
# float64 against the unsplit forest (python/tests/trainer/test_stepplan.py).
RECURRENT = frozenset(
    {
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3NextGatedDeltaNet",
        "OlmoHybridGatedDeltaNet",
        "KimiLinearDeltaAttention",
        "NemotronHMamba2Mixer",
        "BambaMixer",
        "GraniteMoeHybridMambaLayer",
        "FalconH1Mixer",
        "Zamba2MambaMixer",
    }
)


class StepOp(NamedTuple):
    """What one planned micro-batch does with the prefix stack (header keys of the same names)."""

    prefix_tokens: int  # nodes [0, prefix_tokens) are the cached chain: the stack's depth when the micro-batch runs
    push: list[int]  # end depths of the segments pushed before it, ascending, the last = prefix_tokens
    release: int  # segments popped (top first) after it
    # shared prefixes (docs/design.md §11): per push, the piece its data-parallel group computes in shares, or None. A
    # runner of one rank's plan computes such a segment itself, as any other: the same results, the compute of the
    # plan without sharing.
    shared: tuple[int | None, ...] = ()
    # context parallelism (docs/design.md §11): the ranks that run the micro-batch together; () for one rank
    cp_ranks: tuple[int, ...] = ()


def step_op(batch: PackedBatch) -> StepOp:
    """The micro-batch's step-plan entry from its header (``prefix_tokens``, ``prefix_push``, ``prefix_release``); a
    batch without one hangs from nothing."""
    meta = batch.meta

    def num(key: str) -> int:
        v = meta.get(key, 0)
        try:
            n = int(v)
        except (TypeError, ValueError):
            n = -1
        if n < 0 or str(v) != str(n):
            raise TreepackError("E_INPUT", f"{key} is {v!r}, expected an integer >= 0", field=key)
        return n

    push = meta.get("prefix_push", "[]")
    try:
        push = json.loads(push) if isinstance(push, str) else list(push)
    except ValueError:
        push = None
    if not isinstance(push, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in push):
        raise TreepackError("E_INPUT", f"prefix_push is {meta.get('prefix_push')!r}, expected a JSON list of integers", field="prefix_push")

    def ids(key: str, ok: Callable[[Any], bool], expected: str) -> tuple[Any, ...]:
        v = meta.get(key)
        if v is None:
            return ()
        try:
            x = json.loads(v) if isinstance(v, str) else list(v)
        except (TypeError, ValueError):
            x = None
        if not isinstance(x, list) or not ok(x):
            raise TreepackError("E_INPUT", f"{key} is {v!r}, expected {expected}", field=key)
        return tuple(x)

    def is_int(e: Any) -> bool:
        return isinstance(e, int) and not isinstance(e, bool) and e >= 0

    shared = ids(
        "prefix_shared",
        lambda x: len(x) == len(push) and all(e is None or is_int(e) for e in x),
        "a JSON list with a piece id or null per prefix_push entry",
    )
    cp = ids("cp_ranks", lambda x: len(x) >= 2 and all(is_int(e) for e in x), "a JSON list of two or more rank numbers")
    return StepOp(num("prefix_tokens"), push, num("prefix_release"), shared, cp)


@dataclass
class StepResult:
    """What run_step_plan returns: per micro-batch ``losses`` and node ``logprobs`` (detached; NaN where not scored),
    the tokens computed with grad (``computed_tokens``, popped segments included; of a shared piece computed in shares,
    this rank's range) and pushed without it (``pushed_tokens``), the most cached at once (``peak_cached_tokens``,
    ``peak_cached_bytes``) and the bytes the exchanges of shared pieces and context-parallel groups received
    (``exchanged_bytes``). Under context parallelism the tokens are this rank's ranges, the peak tokens the group's
    chain, the bytes this rank's part."""

    losses: list[torch.Tensor]  # per micro-batch, detached
    logprobs: list[torch.Tensor]  # per micro-batch [N], detached; NaN where not scored
    computed_tokens: int  # nodes run with grad: micro-batches' own nodes plus every popped segment
    pushed_tokens: int  # nodes run without grad to fill the cache
    peak_cached_tokens: int
    peak_cached_bytes: int  # keys, values, hidden states, logprobs and their gradient buffers
    exchanged_bytes: int = 0  # received by the exchanges of the shared pieces computed in shares and of context-parallel groups


Key = tuple[Any, ...]  # ("key" | "value", layer_idx) for attention; (layer, "conv" | "state", ordinal) for recurrent layers


class _Segment:
    """Chain nodes [start, end) held on the stack: leaves that gather gradients from everything that reads them (per
    attention layer its keys and values, per recurrent layer its last convolution inputs and final state; the final
    hidden states and node logprobs)."""

    def __init__(
        self,
        start: int,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache: dict[Key, torch.Tensor],
        hidden: torch.Tensor,
        lp: torch.Tensor,
        ent: torch.Tensor | None,
        routes: torch.Tensor | None,
        source: PackedBatch | None,
        routing: Routing | None,
    ) -> None:
        self.start, self.end = start, start + int(ids.shape[0])
        self.ids, self.pos, self.routes = ids, pos, routes  # routes: [MoE layers, n, k], replayed again at the pop
        self.source = source  # a vision-language model's micro-batch it was pushed from: its images, re-encoded at the pop

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_()

        self.cache = {k: leaf(t) for k, t in cache.items()}
        self.hidden, self.lp = leaf(hidden), leaf(lp)
        self.ent = None if ent is None else leaf(ent)
        # with router=True: each MoE layer's router logits [n, experts] (leaves) and the experts used [MoE layers, n, k]
        self.router_logits = None if routing is None else [leaf(t) for t in routing.logits]
        self.experts = None if routing is None else routing.experts()

    def leaves(self) -> list[torch.Tensor]:
        return (
            list(self.cache.values())
            + [self.hidden, self.lp]
            + ([] if self.ent is None else [self.ent])
            + ([] if self.router_logits is None else self.router_logits)
        )

    def nbytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.leaves())  # each leaf and its gradient


class _Prefix:
    """Set as ``prefix`` on a TreeMask of the whole forest (cached chain included), for the layers of one forward of
    nodes [rows, N): the attention asks it to put the cached keys/values before the computed ones (``extend``) and
    computes only the query rows past the cached ones; a recurrent layer reads the cached convolution inputs
    (``tail``) and state (``state``) and leaves its own (``keep``). What each layer computed is ``captured``."""

    def __init__(self, stack: list[_Segment], rows: int) -> None:
        self.stack, self.rows = stack, rows
        self.captured: dict[Key, torch.Tensor] = {}
        self.closed = False  # the forward has returned: what layers re-run now (checkpointing) is not captured

    def keep(self, key: Key, tensor: torch.Tensor) -> None:
        if self.closed:
            return
        if key in self.captured:
            raise TreepackError(
                "E_ARG",
                f"{key} was reported twice in one forward: the step plan cannot tell which layer's cache is which",
                field="layer_idx",
            )
        self.captured[key] = tensor

    def extend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise TreepackError(
                "E_ARG",
                f"{type(module).__name__} has no layer_idx: the step plan cannot tell which layer's cached keys it needs",
                field="layer_idx",
            )
        self.keep(("key", layer), key)
        self.keep(("value", layer), value)
        if not self.rows:
            return query, key, value
        k = torch.cat([s.cache[("key", layer)] for s in self.stack] + [key], dim=2)
        v = torch.cat([s.cache[("value", layer)] for s in self.stack] + [value], dim=2)
        # The cached rows are queries nobody reads (attend skips them): zeros hold their places in the forest's layout.
        q = torch.cat([query.new_zeros(query.shape[:2] + (self.rows, query.shape[3])), query], dim=2)
        return q, k, v

    def tail(self, key: Key, t: int) -> torch.Tensor:
        """The convolution inputs of the chain's last t nodes [1, C, t]: each segment holds its last K-1 (or all)."""
        return torch.cat([s.cache[key] for s in self.stack], dim=2)[:, :, -t:]

    def state(self, key: Key) -> torch.Tensor:
        """The recurrent state after the chain's last node [1, ...]: the top segment's."""
        return self.stack[-1].cache[key]


def check_model(model: torch.nn.Module) -> None:
    """Refuses (TreepackError) a model with a token mixer whose prefix state the step plan does not carry: anything
    but softmax attention and the recurrent layers of ``RECURRENT``, by layer index and class."""
    handled = token_mixers(model)[0]
    refuse_unsupported(
        model,
        RECURRENT,
        "its prefix state is not carried by the step-plan executor (attention and " + ", ".join(sorted(RECURRENT)) + " are; "
        "run these micro-batches in full)",
    )
    recurrent = {layer_index(p) for p, _ in handled}
    for i, kind in enumerate(getattr(model.config, "layer_types", None) or []):
        if kind not in _ATTENTION_TYPES and str(i) not in recurrent:
            raise TreepackError(
                "E_ARG",
                f"layer {i} is of type {kind!r} but holds no recurrent layer the step-plan executor knows: it caches attention keys/values "
                "and the states of " + ", ".join(sorted(RECURRENT)) + " only (run these micro-batches in full)",
                field="layer_types",
            )
    for path, m in handled:
        if getattr(m, "treepack_chunk_align", False):
            raise TreepackError(
                "E_ARG",
                f"layer {layer_index(path)} ({path}) was prepared with chunk_align=True: a branch hanging from a cached state starts "
                "where the cache ends, off the chunk grid (prepare(model, chunk_align=False) for step plans)",
                field="chunk_align",
            )


def _data_parallel(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None]:
    """The Hugging Face model the executor runs (inside DDP and PEFT wrappers) and the DDP wrapper, if any. FSDP and
    DeepSpeed are refused: the executor calls the model's layers itself, and only their own forward gathers the
    sharded parameters."""
    levels = wrappers(model)
    for m in levels:
        sharded = (
            next((x for x in m.modules() for c in type(x).__mro__ if c.__name__ in ("FSDPModule", "FullyShardedDataParallel")), None)
            if m is levels[-1]
            else (m if type(m).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine") else None)
        )
        if sharded is not None:
            raise TreepackError(
                "E_ARG",
                f"the step-plan executor runs the model's layers itself, so it cannot run under {type(sharded).__name__}, whose "
                "forward gathers the sharded parameters (DistributedDataParallel or one process)",
                field="model",
            )
    ddp = next((m for m in levels if isinstance(m, torch.nn.parallel.DistributedDataParallel)), None)
    return levels[-1], ddp


def sync_gradients(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Averages the gradients of a ``DistributedDataParallel`` model's parameters over its process group in one
    all-reduce, as DDP's backward does at the end of an accumulation (a parameter this rank never reached counts as
    zero, so every rank takes part, an idle one too). The step-plan executor runs outside DDP's forward, so DDP's own
    hooks never fire: call this once per optimizer step, after the rank's last micro-batch (``run_step_plan`` does)."""
    import torch.distributed as dist

    params = [p for p in ddp.module.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=ddp.process_group)
    flat.div_(dist.get_world_size(ddp.process_group))
    for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


# A rank's planned micro-batches run in plan order, from the first of its step, in one process (treepack serve
# hands them out so: FeedClient); anything else finds a stack other than the one the plan built.
_ORDER = ": micro-batches out of plan order (a rank's planned micro-batches of a step run in order, from its first, in one trainer)"


def _chain_batch(ids: torch.Tensor, pos: torch.Tensor, routes: torch.Tensor | None) -> PackedBatch:
    """A chain of n nodes as a forest: one sequence through all of them (only its node arrays and routes are read)."""
    n, dev = int(ids.shape[0]), ids.device
    ar = torch.arange(n, device=dev)
    return PackedBatch(
        input_ids=ids,
        position_ids=pos,
        parent=ar - 1,
        subtree_end=torch.full((n,), n, device=dev, dtype=torch.int64),
        seq_offsets=torch.tensor([0, n], device=dev),
        seq_positions=ar,
        loss_mask=torch.zeros(n, dtype=torch.bool, device=dev),
        seq_index=torch.zeros(n, dtype=torch.int64, device=dev),
        token_index=ar,
        meta={"num_tokens_packed": n},
        routes=routes,
    )


class StepPlanRunner:
    """Runs the micro-batches of one rank's step plan, in order (``run_step_plan`` is the one-call form): ``run(batch,
    loss_fn)`` per micro-batch, then ``finish()``. A trainer that computes and back-propagates the loss itself (TRL)
    calls ``forward(batch)`` (its pushes and forward: scores connected to the cached leaves), back-propagates, then
    ``release()`` (its pops). ``temperature`` divides the logits; ``entropy`` also returns (and caches) entropies.
    ``model`` may be wrapped in DistributedDataParallel (and PEFT): the executor runs the model inside, outside DDP's
    forward, so no backward synchronises; ``sync_gradients()`` then averages the gradients once per optimizer step.
    ``router=True`` (a MoE model): ``forward`` returns the micro-batch's router outputs (``NodeScores.router``, every
    node's, the cached prefix's included) and ``run`` calls ``loss_fn(logprobs, batch, router)``."""

    def __init__(
        self,
        model: torch.nn.Module,
        attention: str = "auto",
        chunk_size: int = 1024,
        block_size: int = 128,
        temperature: float = 1.0,
        entropy: bool = False,
        image_processor: Any = None,
        router: bool = False,
    ) -> None:
        model, self.ddp = _data_parallel(model)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != "treepack":
            raise TreepackError(
                "E_ARG",
                f"the step-plan executor needs attn_implementation 'treepack' (it extends the tree mask to cached keys), got {impl!r}",
                field="attn_implementation",
            )
        if not temperature > 0:
            raise TreepackError("E_ARG", f"expected a number > 0, got {temperature!r}", field="temperature")
        softcap = getattr(model.config, "final_logit_softcapping", None)
        if softcap:
            raise TreepackError(
                "E_ARG",
                "the step-plan executor scores hidden states with the LM head and does not softcap final logits "
                f"(final_logit_softcapping = {softcap})",
                field="final_logit_softcapping",
            )
        check_model(model)
        prepare(model)  # recurrent layers run on the tree (idempotent)
        for name, m in model.named_modules():
            # A prefix is run twice (pushed, then popped with grad): both must compute the same values.
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training:
                raise TreepackError(
                    "E_ARG",
                    f"{name} is dropout (p = {m.p}) in training mode: a step plan runs each prefix twice and needs both runs "
                    "equal (call model.eval() or set p = 0)",
                    field="dropout",
                )
        self.model, self.attention, self.chunk_size, self.block_size = model, attention, chunk_size, block_size
        self.temperature, self.entropy, self.router = float(temperature), entropy, router
        self.router_meta: tuple[tuple[str, ...], float | None] | None = None  # the routers' kinds and aux coefficient
        self.vision, self.image_processor = vision_family(model) is not None, image_processor
        self.recurrent = bool(token_mixers(model)[0])
        self.head, self.base = _head_and_base(model)
        self.stack: list[_Segment] = []
        self.keys: list[Key] | None = None  # what every forward caches: fixed by the first one
        self.pending: int | None = None  # segments the micro-batch forwarded last pops at release()
        self.computed = self.pushed = self.peak_tokens = self.peak_bytes = 0
        # shared pieces this rank holds for the window (docs/design.md §11), by id, with its part of each
        self.held: dict[int, _Segment] = {}
        # context-parallel groups this rank runs micro-batches with (python/treepack/torch/cp_plan.py), by cp_ranks
        self.cp_plans: dict[tuple[int, ...], CPPlan] = {}
        self.cp_active: CPPlan | None = None  # the group of the micro-batch forwarded last, if it was one
        self.shares: dict[int, Share] = {}
        self.exchanged = 0  # bytes received by the shared pieces' exchanges

    @property
    def depth(self) -> int:
        """The depth of the cached prefix stack: tokens held cached for the next micro-batch."""
        return self.stack[-1].end if self.stack else 0

    def _forward(self, forest: PackedBatch, rows: int, source: PackedBatch | None, ctx: Any = None) -> Any:
        """The base model on nodes [rows, N) of ``forest`` against the stack (which holds nodes [0, rows)): final
        hidden states [N - rows, D] and what each layer would cache for them. A vision-language model takes those
        nodes' images and 3-D positions from ``source``, the micro-batch whose nodes [rows, N) they are. ``ctx``: the
        hook that supplies rows [0, rows) (a shared piece's member: ``GroupPrefix``); default the stack's."""
        mask = tree_mask(forest, mode=self.attention, block_size=self.block_size)
        mask.prefix = ctx = _Prefix(self.stack, rows) if ctx is None else ctx
        # A MoE model replays the routes of the nodes it computes (a cached node's were replayed when it was pushed).
        routes = forest.routes
        replay: Any = contextlib.nullcontext()
        if routes is not None or self.router:
            replay = replay_routes(self.model, None if routes is None else routes[:, rows:], tokens=forest.num_nodes - rows)
        with replay as routing:
            if self.vision and source is not None:
                hidden = hidden_states(self.model, source, mask, self.image_processor, start=rows, end=forest.num_nodes)
            else:
                ids, pos = forest.input_ids[None, rows:], forest.position_ids[None, rows:]
                hidden = self.base(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).last_hidden_state[0]
        ctx.closed = True  # gradient checkpointing re-runs layers in the backward: they read the cache, capture nothing
        keys = sorted(ctx.captured, key=repr)
        if self.keys is None:
            if not keys:
                raise TreepackError(
                    "E_ARG",
                    "no layer reported keys/values or a recurrent state: the model's layers do not go through treepack's attention",
                    field="attn_implementation",
                )
            self.keys = keys
        elif keys != self.keys:
            raise TreepackError(
                "E_ARG",
                f"this forward's layers cached {keys}, the first one's {self.keys}: the step plan needs the same layers in every forward",
                field="layer_idx",
            )
        if not self.router:
            return hidden, ctx.captured, None
        out = router_outputs(routing, self.model)
        self.router_meta = (out.kinds, out.aux_coef)
        return hidden, ctx.captured, routing

    def _scores(self, hidden: torch.Tensor, forest: PackedBatch, nodes: torch.Tensor) -> Any:
        s = packed_logprobs(
            hidden, forest, chunk_size=self.chunk_size, nodes=nodes, lm_head=self.head, entropy=self.entropy, temperature=self.temperature
        )
        return s.logprobs, s.entropy

    def _segment_pass(
        self, ids: torch.Tensor, pos: torch.Tensor, routes: torch.Tensor | None, start: int, source: PackedBatch | None
    ) -> Any:
        """Chain nodes [start, start + n) on the stack: what each layer caches for them, hidden states and node
        logprobs and entropies (from the parent's hidden state, the stack's top row for the first node; a root has
        none: 0)."""
        below = routes is None or any(s.routes is None for s in self.stack)
        chain_routes = (
            None if below else torch.cat([cast(torch.Tensor, s.routes) for s in self.stack] + [cast(torch.Tensor, routes)], dim=1)
        )
        chain = _chain_batch(torch.cat([s.ids for s in self.stack] + [ids]), torch.cat([s.pos for s in self.stack] + [pos]), chain_routes)
        hidden, cache, routing = self._forward(chain, start, source)
        full = torch.cat([s.hidden for s in self.stack] + [hidden])
        lp, ent = self._scores(full, chain, torch.arange(max(start, 1), chain.num_nodes, device=ids.device))

        def zero(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.nan_to_num(t[start:], nan=0.0)

        return cache, hidden, zero(lp), zero(ent), routing

    def _push(self, batch: PackedBatch, end: int) -> None:
        start = self.depth
        ids, pos = batch.input_ids[start:end], batch.position_ids[start:end]
        routes = None if batch.routes is None else batch.routes[:, start:end]
        source = batch if self.vision else None
        with torch.no_grad():
            cache, hidden, lp, ent, routing = self._segment_pass(ids, pos, routes, start, source)
        self.stack.append(_Segment(start, ids, pos, cache, hidden, lp, ent, routes, source, routing))
        self.pushed += end - start
        self.peak_tokens = max(self.peak_tokens, self.depth)
        self.peak_bytes = max(self.peak_bytes, sum(s.nbytes() for s in self.stack))

    def _take(self, batch: PackedBatch, seg: _Segment) -> None:
        """A shared piece pushed from what this rank holds: its leaves gather the gradients of every micro-batch."""
        if seg.start != self.depth or not torch.equal(seg.ids, batch.input_ids[seg.start : seg.end]):
            raise TreepackError(
                "E_INPUT",
                f"the micro-batch's depths [{seg.start}, {seg.end}) are not the shared piece it names (tokens or stack depth "
                f"{self.depth} differ){_ORDER}",
                field="prefix_shared",
            )
        self.stack.append(seg)
        self.peak_tokens = max(self.peak_tokens, self.depth)

    def _pop(self) -> None:
        seg = self.stack.pop()
        if any(seg is held for held in self.held.values()):
            return  # a shared piece: its group back-propagates it after the window (release_shared)
        if all(leaf.grad is None for leaf in seg.leaves()):
            return  # nothing read it: no gradient to carry
        cache, hidden, lp, ent, routing = self._segment_pass(seg.ids, seg.pos, seg.routes, seg.start, seg.source)
        pairs = [(cache[k], t.grad) for k, t in seg.cache.items()] + [(hidden, seg.hidden.grad), (lp, seg.lp.grad)]
        if ent is not None and seg.ent is not None:
            pairs.append((ent, seg.ent.grad))
        if routing is not None and seg.router_logits is not None:
            pairs += [(t, leaf.grad) for t, leaf in zip(routing.logits, seg.router_logits)]
        pairs = [(t, g) for t, g in pairs if g is not None]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.computed += seg.end - seg.start

    def _check(self, batch: PackedBatch, op: StepOp, stack: Sequence[Any] | None = None) -> None:
        """The micro-batch against the plan and ``stack`` (this rank's own, or a context-parallel group's parts)."""
        stack = self.stack if stack is None else stack
        h, N = op.prefix_tokens, batch.num_nodes
        if h > N:
            raise TreepackError("E_INPUT", f"prefix_tokens = {h} but the micro-batch has N = {N} nodes", field="prefix_tokens")
        ar = torch.arange(h, device=batch.device)
        if h and (not torch.equal(batch.parent[:h], ar - 1) or not torch.equal(batch.position_ids[:h], ar)):
            raise TreepackError(
                "E_INPUT",
                f"nodes [0, {h}) are not a chain from a root (parent p - 1, position p): they cannot be a cached prefix",
                field="prefix_tokens",
            )
        if self.recurrent and h:
            # A recurrent layer's cached state is the one after the chain's last node: nothing may branch off above it.
            p = batch.parent[h:]
            above = torch.nonzero((p >= 0) & (p < h - 1)).flatten()
            if above.numel():
                j = int(above[0]) + h
                raise TreepackError(
                    "E_INPUT",
                    f"node {j}'s parent {int(batch.parent[j])} lies inside the cached prefix [0, {h}), not at its last node: "
                    "a recurrent layer's cached state exists only at the prefix's end",
                    field="prefix_tokens",
                )
        depth = stack[-1].end if stack else 0
        if h and depth:
            held = torch.cat([s.ids for s in stack])[: min(depth, h)]
            held_images = [k for s in stack for k in image_keys(s.source, s.start, s.end)] if self.vision else []
            if not torch.equal(held, batch.input_ids[: held.shape[0]]) or held_images[: held.shape[0]] != (
                image_keys(batch, 0, held.shape[0]) if self.vision else []
            ):
                raise TreepackError(
                    "E_INPUT",
                    "the micro-batch's prefix is not the one this rank holds: micro-batches out of plan order, or the plan of another step",
                    field="prefix_push",
                )
            # A node is its token and its route: a prefix routed otherwise is another prefix (the planner splits there).
            n, routes = held.shape[0], [s.routes for s in stack] + [batch.routes]
            if any(r is not None for r in routes) and (
                any(r is None for r in routes)
                or not torch.equal(torch.cat(cast(list[torch.Tensor], routes[:-1]), 1)[:, :n], cast(torch.Tensor, batch.routes)[:, :n])
            ):
                raise TreepackError(
                    "E_INPUT",
                    "the micro-batch's prefix routes differ from those of the prefix this rank holds (or only one has routes)",
                    field="routes",
                )
        ends = [depth] + op.push
        if any(b <= a for a, b in zip(ends, ends[1:])) or (op.push and op.push[-1] != h) or (not op.push and depth != h):
            raise TreepackError(
                "E_INPUT",
                f"prefix_push = {op.push} does not take the stack from depth {depth} to prefix_tokens = {h}{_ORDER}",
                field="prefix_push",
            )
        if op.release > len(stack) + len(op.push):
            raise TreepackError(
                "E_INPUT",
                f"prefix_release = {op.release} but the stack will hold {len(stack) + len(op.push)} segments{_ORDER}",
                field="prefix_release",
            )

    def forward(self, batch: PackedBatch, op: StepOp | None = None) -> NodeScores:
        """One micro-batch's pushes and forward: ``NodeScores`` of its trainable nodes ([N], NaN elsewhere), the
        cached chain's own nodes taking the scores computed at push (their leaves gather the gradient). Back-propagate
        the loss, then call ``release()``."""
        if self.pending is not None:
            raise TreepackError("E_ARG", "the previous micro-batch was not released: call release() after its backward", field="release")
        op = step_op(batch) if op is None else op
        if batch.context_parallel is not None:
            raise TreepackError("E_ARG", "a step plan cannot run a context-parallel local part (not supported yet)", field="batch")
        if not self.vision and has_images(batch):
            raise TreepackError(
                "E_ARG", f"{type(self.model).__name__} has no vision encoder, but the batch has images", field="image_fills"
            )
        check_vocabulary(self.model, batch)
        if op.cp_ranks:
            scores = self._cp_plan(op).forward(batch, op)
            self.pending, self.cp_active = op.release, self.cp_plans[op.cp_ranks]
            return scores
        if any(p.stack for p in self.cp_plans.values()):
            raise TreepackError(
                "E_INPUT",
                f"a micro-batch of this rank alone while a context-parallel group's segments are cached{_ORDER}",
                field="cp_ranks",
            )
        self._check(batch, op)
        for j, end in enumerate(op.push):
            pid = op.shared[j] if op.shared else None
            if pid is not None and pid in self.held:
                self._take(batch, self.held[pid])
            else:
                self._push(batch, end)
        self.pending = op.release
        h, N = op.prefix_tokens, batch.num_nodes
        targets = scored_nodes(batch)
        if N == 0:  # an empty step (ranks are padded to equal step counts): nothing to run or to score
            empty = torch.zeros(0, dtype=torch.float64)
            return NodeScores(empty, empty if self.entropy else None, targets)
        routing = None
        if N > h:
            hidden, _, routing = self._forward(batch, h, batch)
        else:  # every node is cached (sequences that end on the chain): only the loss runs
            hidden = self.stack[-1].hidden.new_zeros((0, self.stack[-1].hidden.shape[1]))
        full = torch.cat([s.hidden for s in self.stack] + [hidden]) if h else hidden
        lp, ent = self._scores(full, batch, targets[targets >= h])
        if h:
            old = targets[targets < h]
            lp = lp.index_put((old,), torch.cat([s.lp for s in self.stack])[old])
            if ent is not None:
                ent = ent.index_put((old,), torch.cat([cast(torch.Tensor, s.ent) for s in self.stack])[old])
        self.computed += N - h
        return NodeScores(lp, ent, targets, self._router(routing) if self.router else None)

    def _cp_plan(self, op: StepOp) -> CPPlan:
        """The group that runs a micro-batch planned for ``op.cp_ranks`` (python/treepack/torch/cp_plan.py)."""
        if self.vision:
            raise TreepackError(
                "E_ARG",
                f"{type(self.model).__name__} has a vision encoder: micro-batches planned for context-parallel ranks {list(op.cp_ranks)} "
                "run on language models so far (pack without --cp)",
                field="cp_ranks",
            )
        if self.stack or any(p.stack for k, p in self.cp_plans.items() if k != op.cp_ranks):
            raise TreepackError(
                "E_INPUT",
                f"a micro-batch of context-parallel ranks {list(op.cp_ranks)} while other segments are cached{_ORDER}",
                field="cp_ranks",
            )
        if op.cp_ranks not in self.cp_plans:
            self.cp_plans[op.cp_ranks] = CPPlan(self, op.cp_ranks, _chain_batch)
        return self.cp_plans[op.cp_ranks]

    def _router(self, routing: Routing | None) -> RouterOutputs:
        """The micro-batch's router outputs: the cached segments' logits (leaves) and experts, then its own."""
        if any(s.router_logits is None or s.experts is None for s in self.stack):
            raise TreepackError("E_ARG", "a cached prefix was pushed without its router logits (router=False)", field="router")
        logits = [cast(list[torch.Tensor], s.router_logits) for s in self.stack]
        experts = [cast(torch.Tensor, s.experts) for s in self.stack]
        if routing is not None:
            logits.append(list(routing.logits))
            experts.append(routing.experts())
        kinds, coef = cast(tuple[tuple[str, ...], float | None], self.router_meta)
        return RouterOutputs(tuple(torch.cat(ls) for ls in zip(*logits)), torch.cat(experts, dim=1), kinds, coef)

    def share(self, pieces: Sequence[Mapping[str, Any]], batches: Sequence[PackedBatch], ops: Sequence[StepOp] | None = None) -> None:
        """Before the window's first micro-batch (python/treepack/torch/shared_prefix.py): ``pieces`` are the window's
        entries of the manifest's ``shared_prefixes`` (the same list on every rank), ``batches`` this rank's
        micro-batches of the window, in order. Every rank creates the pieces' process groups; each piece this rank is a
        member of is computed in shares with its group and held for the window, its gradients returned by
        ``release_shared()`` after the window's last micro-batch."""
        if self.stack or self.held or self.pending is not None:
            raise TreepackError("E_ARG", "share() comes before the window's first micro-batch", field="shared_prefixes")
        ps = [Piece.of(e, i) for i, e in enumerate(pieces)]
        if not ps:
            return
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise TreepackError(
                "E_ARG", "shared pieces are computed by their ranks together: initialise torch.distributed", field="shared_prefixes"
            )
        if self.recurrent and getattr(self.model, "is_gradient_checkpointing", False):
            raise TreepackError(
                "E_ARG",
                "gradient checkpointing re-runs the recurrent layers in the backward, and a shared piece's state hand-overs "
                "between its ranks run once per forward: turn it off to compute shared pieces in shares",
                field="gradient_checkpointing",
            )
        groups = {p.id: group_of(p.ranks) for p in ps}  # every rank, in list order: dist.new_group's contract
        rank = dist.get_rank()
        ops = [step_op(b) for b in batches] if ops is None else list(ops)
        plan = plan_shares(ps, batches, ops, rank)
        for p in ps:
            got = plan.get(p.id)
            if got is None:
                continue
            source, below, reads = got
            if any(q not in self.held for q in below):
                raise TreepackError(
                    "E_INPUT", f"shared piece {p.id} is listed before a piece above it on its chain {below}", field="shared_prefixes"
                )
            share = Share(p, groups[p.id], rank, source, below, reads)
            with torch.no_grad():
                cache, hidden, lp, ent, routing = self._piece_pass(share)
            self.shares[p.id] = share
            ids, pos = source.input_ids[p.start : p.end], source.position_ids[p.start : p.end]
            routes = None if source.routes is None else source.routes[:, p.start : p.end]
            seen = source if self.vision else None  # its images: a micro-batch's prefix must show the same ones
            self.held[p.id] = _Segment(p.start, ids, pos, cache, hidden, lp, ent, routes, seen, routing)
            self.pushed += share.b - share.a
        self.peak_bytes = max(self.peak_bytes, sum(h.nbytes() for h in self.held.values()))

    def _piece_pass(self, share: Share) -> Any:
        """This rank's range of a shared piece against the pieces below and the ranges before (fetched), gathered into
        the whole piece: per-layer keys/values (recurrent layers: the piece's final states and convolution inputs),
        the final hidden rows some member's micro-batches read, node logprobs and entropies, and with ``router=True``
        its routing (as ``_segment_pass``; a routed piece's nodes replay their routes; a vision-language model encodes
        the images that fill a node of the range, an image across two ranges by both members, each its placeholders).
        Each member scores only its nodes [lo, hi) (``Share``), from the rows it computed (and the first member the
        piece's first node from the row below): the LM head runs once per piece node in the group."""
        src = share.source
        stack = [self.held[q] for q in share.below]
        routes = None if src.routes is None else src.routes[:, : share.b]
        chain = _chain_batch(src.input_ids[: share.b], src.position_ids[: share.b], routes)
        prefix = GroupPrefix(stack, share)
        hidden, cache, routing = self._forward(chain, share.a, src if self.vision else None, prefix)
        cache = prefix.whole(cache)
        routing = None if routing is None else share.routing(routing)
        # Rows [lo - 1, hi - 1) as a chain of nodes [lo - 1, hi): the last node's own row is read by nobody.
        first = max(share.lo - 1, 0)
        rows = [stack[-1].hidden[-1:]] if first < share.a else []
        part = torch.cat(rows + [hidden[: share.hi - 1 - share.a], hidden.new_zeros((1, hidden.shape[1]))])
        own = _chain_batch(src.input_ids[first : share.hi], src.position_ids[first : share.hi], None)
        lp, ent = self._scores(part, own, torch.arange(max(share.lo, 1) - first, share.hi - first, device=part.device))
        hidden = share.gather_read(hidden, "the final hidden states")

        def gathered(t: torch.Tensor | None, what: str) -> torch.Tensor | None:
            return None if t is None else share.gather(torch.nan_to_num(t[share.lo - first :], nan=0.0), what, share.scored)

        return cache, hidden, gathered(lp, "the node logprobs"), gathered(ent, "the node entropies"), routing

    def release_shared(self) -> None:
        """After the window's last micro-batch: each held piece, in reverse list order, recomputed by its members with
        grad and back-propagated with the gradients its leaves gathered on every member (summed into each range's
        owner by the gather's backward). Every member of a piece must call it."""
        if self.stack or self.pending is not None:
            raise TreepackError(
                "E_INPUT",
                "shared pieces are released after the window's last micro-batch (the stack still holds segments)",
                field="prefix_release",
            )
        for pid in reversed(list(self.held)):
            seg, share = self.held.pop(pid), self.shares.pop(pid)
            cache, hidden, lp, ent, routing = self._piece_pass(share)
            pairs = [(cache[k], t) for k, t in seg.cache.items()] + [(hidden, seg.hidden), (lp, seg.lp)]
            if ent is not None and seg.ent is not None:
                pairs.append((ent, seg.ent))
            if routing is not None and seg.router_logits is not None:
                pairs += list(zip(routing.logits, seg.router_logits))
            # Every member back-propagates through the same exchanges, a gradient nobody read as zeros.
            grads = [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for _, leaf in pairs]
            torch.autograd.backward([t for t, _ in pairs], grads)
            self.computed += share.b - share.a
            self.exchanged += share.stats.get("received_bytes", 0)

    def release(self) -> None:
        """The pops of the micro-batch forwarded last (after its loss was back-propagated): each segment recomputed
        with grad and back-propagated with the gradients its leaves gathered."""
        if self.pending is None:
            raise TreepackError("E_ARG", "release() without a forwarded micro-batch", field="release")
        if self.cp_active is not None:
            self.cp_active.release(self.pending)
        else:
            for _ in range(self.pending):
                self._pop()
        self.pending = self.cp_active = None

    def sync_gradients(self) -> None:
        """With DDP, the one all-reduce of an optimizer step (``sync_gradients``): refused while a prefix is cached, whose
        gradient is not complete yet. Nothing to do in one process."""
        if self.pending is not None or self.stack or self.held or any(p.stack for p in self.cp_plans.values()):
            raise TreepackError(
                "E_INPUT",
                f"gradients synchronised while the step plan holds {self.depth} cached prefix tokens: their gradient is not "
                "complete until they are released (synchronise after the rank's last micro-batch of the step)",
                field="prefix_release",
            )
        if self.ddp is not None:
            sync_gradients(self.ddp)

    def run(self, batch: PackedBatch, loss_fn: Callable[[torch.Tensor, PackedBatch], torch.Tensor], op: StepOp | None = None) -> Any:
        """One micro-batch: its pushes, its forward and backward (``loss_fn(logprobs [N], batch)`` → scalar), its
        releases. Returns (loss, logprobs [N]), detached."""
        scores = self.forward(batch, op)
        if batch.num_nodes == 0:
            self.release()
            return torch.zeros((), dtype=torch.float64), scores.logprobs
        loss = loss_fn(scores.logprobs, batch, scores.router) if self.router else loss_fn(scores.logprobs, batch)  # type: ignore[call-arg]
        if loss.requires_grad:
            loss.backward()
        self.release()
        return loss.detach(), scores.logprobs.detach()

    def finish(self) -> None:
        """Checks the plan released every prefix (a step's plan leaves nothing cached)."""
        if self.pending is not None:
            self.release()
        if self.stack:
            depth = self.depth
            while self.stack:
                self._pop()
            raise TreepackError(
                "E_INPUT",
                f"the step plan ended with {depth} cached prefix tokens never released (their gradients were applied now)",
                field="prefix_release",
            )
        for ranks, plan in self.cp_plans.items():
            if plan.stack:
                depth = plan.stack[-1].end
                plan.release(len(plan.stack))  # every rank of the group ends the same plan so: they pop together
                raise TreepackError(
                    "E_INPUT",
                    f"the step plan ended with {depth} cached prefix tokens of context-parallel ranks {list(ranks)} never released "
                    "(their gradients were applied now)",
                    field="prefix_release",
                )
        self.release_shared()


def run_step_plan(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    loss_fn: Callable[[torch.Tensor, PackedBatch], torch.Tensor],
    ops: Sequence[StepOp] | None = None,
    attention: str = "auto",
    chunk_size: int = 1024,
    block_size: int = 128,
    temperature: float = 1.0,
    sync: bool = True,
    image_processor: Any = None,
    router: bool = False,
    shared_prefixes: Sequence[Mapping[str, Any]] | None = None,
) -> StepResult:
    """Runs one rank's planned micro-batches forward and backward, in order; the parameters' ``.grad`` then holds the
    sum of every micro-batch's loss gradient, as with ordinary gradient accumulation. ``ops`` overrides the plan
    read from each batch's header; ``attention`` and ``block_size`` are ``tree_mask``'s (the block path skips the query
    blocks that hold only cached rows); ``temperature`` divides the logits. With ``model`` wrapped in
    DistributedDataParallel (every rank calls this with its own micro-batches of the step), the gradients are then
    averaged over the ranks in one all-reduce, as DDP's own accumulation would (``sync=False``: not yet, for a step
    spread over several calls; ``sync_gradients(model)`` after the last). ``image_processor``: a vision-language
    model's (``packed_logprobs``'). ``router=True`` (a MoE model): ``loss_fn(logprobs, batch, router)`` gets the
    micro-batch's ``RouterOutputs``, the cached prefix's included, for the load-balancing loss, e.g.
    ``lambda lp, b, r: tpt.packed_loss(lp, b, cfg, router=r, aux_coef=0.01)[0]``: value and gradient those of the
    micro-batch run in full. ``shared_prefixes``: the window's entries of the manifest's ``shared_prefixes``,
    the same list on every rank (``batches`` are then this rank's micro-batches of that window): the pieces are
    computed in shares with the other ranks (python/treepack/torch/shared_prefix.py); None: each rank computes the
    pieces it holds itself (the same results).
    A micro-batch planned for a context-parallel group (``cp_ranks``; ``treepack.list_microbatches(dir, rank=r)``
    lists a rank's, its groups' included) runs with every rank of the group (python/treepack/torch/cp_plan.py): the
    groups are created first on every rank (``make_groups``), and each member's ``losses`` holds the whole
    micro-batch's loss, its ``.grad`` its share of the gradient."""
    runner = StepPlanRunner(
        model,
        attention=attention,
        chunk_size=chunk_size,
        block_size=block_size,
        temperature=temperature,
        image_processor=image_processor,
        router=router,
    )
    # Every rank creates the context-parallel groups its micro-batches name, and those of the other ranks (cp_plan.py).
    make_groups(step_op(b) for b in batches) if ops is None else make_groups(ops)
    if shared_prefixes:
        runner.share(shared_prefixes, batches, ops)
    losses, lps = [], []
    for i, batch in enumerate(batches):
        loss, lp = runner.run(batch, loss_fn, None if ops is None else ops[i])
        losses.append(loss)
        lps.append(lp)
    runner.finish()
    if sync:
        runner.sync_gradients()
    return StepResult(losses, lps, runner.computed, runner.pushed, runner.peak_tokens, runner.peak_bytes, runner.exchanged)


__all__ = ["RECURRENT", "StepOp", "StepPlanRunner", "StepResult", "check_model", "run_step_plan", "step_op", "sync_gradients"]
