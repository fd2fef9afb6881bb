"""Node logprobs of a packed forward without [N, vocab] logits.

Node p's logprob is ``log_softmax(logits[parent[p]])[input_ids[p]]`` (docs/concepts/prefix-trees.md), so the LM
head is needed only at the parents of the nodes that are scored: by default the nodes some trainable occurrence maps
to. Those parents (a branch point's row serves all its children) go through the head in chunks of at most
``chunk_size`` rows, so at most one chunk's logits exist at a time, forward or backward.

A linear head (every Hugging Face causal LM's) runs in one autograd function that writes each chunk's logits into
one reused buffer and works on it in place, and whose backward is written out (the gradient of a logprob is the
one-hot of its token minus the row's probabilities; of an entropy, ``-p * (log p + H)``): a chunk costs one
[rows, vocab] buffer and a handful of passes over it, where autograd's log_softmax, gather and their backward
allocate and fill several. Backward recomputes each chunk's logits (one more matmul per row) instead of keeping
them. Any other head module runs through autograd, each chunk under activation checkpointing when there are several.

    >>> import torch, treepack, treepack.torch as tpt
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> batch = tpt.load_microbatch(treepack.list_microbatches("packed")[0])
    >>> scores = packed_logprobs(model, batch, entropy=True)     # runs the model packed (attn "treepack" or sdpa)
    >>> scores.logprobs.shape, scores.logprobs.isnan().sum().item()   # [N]; NaN at nodes not scored (the prompt's 4)
    (torch.Size([10]), 4)
    >>> per_token = gather_occurrences(scores.logprobs, batch)   # [M], sequence i's token t at seq_offsets[i] + t
    >>> alone = tpt.naive_batch(batch)                           # the same sequences, nothing shared
    >>> reference = gather_occurrences(packed_logprobs(model, alone).logprobs, alone)
    >>> torch.allclose(per_token[batch.loss_mask], reference[alone.loss_mask], atol=1e-5)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..microbatch import TreepackError
from . import cp_recurrent
from .attention import dense_model_mask, input_embeddings, tree_mask
from .batch import PackedBatch
from .models import check_context_parallel, check_dense, prepare
from .moe import RouterOutputs, replay_routes, router_outputs
from .vision import has_images, vision_family
from .vision import hidden_states as vision_hidden_states


class NodeScores(NamedTuple):
    """Node scores of a packed forward: ``logprobs`` [N] and ``entropy`` [N] (or None) of the distribution predicting
    each node, NaN where not scored, the scored ``nodes`` (int64, ascending), and for a MoE model asked for it the
    ``router`` outputs (``treepack.torch.moe``: logits and experts per MoE layer, for ``load_balancing_loss``)."""

    logprobs: torch.Tensor  # float32 (or the hidden states' dtype if float64) [N]; NaN where not scored
    entropy: torch.Tensor | None  # [N], the entropy of the distribution that predicts node p; NaN where not scored
    nodes: torch.Tensor  # int64 [K], the scored nodes, ascending
    router: RouterOutputs | None = None  # a MoE model's routing, when routes were replayed or router=True


def gather_occurrences(node_values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-occurrence values [M] from per-node values [N] (the unmerge); its backward sums each node's occurrences."""
    if node_values.shape[0] != batch.num_nodes:
        raise TreepackError("E_ARG", f"expected {batch.num_nodes} node values, got {node_values.shape[0]}", field="node_values")
    return node_values.index_select(0, batch.seq_positions.to(node_values.device))


class _WholeRow(torch.autograd.Function):
    """A local part's node values [A + n] → the whole row's [N] (each rank's local nodes all-gathered in rank order);
    backward keeps the gradient of this rank's local nodes and sends nothing: every rank computes the same function
    of the same whole row, so each owner's slice of it is the one-rank gradient of its nodes."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, part: Any) -> torch.Tensor:
        import torch.distributed as dist

        from .context_parallel import _collective

        cp, A = part.cp, part.rows
        ctx.A, ctx.rows, ctx.lo = A, values.shape[0], cp.lo
        sizes = [b - a for a, b in zip(cp.bounds, cp.bounds[1:])]
        buf = values.new_zeros(max(sizes))
        buf[: sizes[cp.rank]] = values[A:]
        parts = [torch.empty_like(buf) for _ in sizes]
        _collective(cp, "the all-gather of the row's node scores", lambda: dist.all_gather(parts, buf, group=cp.group))
        return torch.cat([x[:k] for x, k in zip(parts, sizes)])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        mine = g.new_zeros(ctx.rows)
        mine[ctx.A :] = g[ctx.lo : ctx.lo + ctx.rows - ctx.A]
        return mine, None


def whole_row(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """On a rank's local part of a context-parallel row (``treepack.torch.split_batch``): its per-node values
    [A + n] (``packed_logprobs``' logprobs or entropies) as the whole row's [N], the same on every rank of the group
    (one all-gather; every rank must call it). A loss of the whole row computed on every rank then has the one-rank
    value, and its gradient flows into this rank's local nodes only: the ranks' parameter gradients sum to the
    one-rank gradient (``reduce_gradients``). How the TRL integration runs TRL's loss unchanged under context
    parallelism (``treepack.integrations.trl``); ``packed_loss`` instead takes each rank's share."""
    part = batch.context_parallel
    if part is None:
        raise TreepackError("E_ARG", "whole_row takes a context-parallel local part (treepack.torch.split_batch)", field="batch")
    if values.shape[0] != batch.num_nodes:
        raise TreepackError("E_ARG", f"expected {batch.num_nodes} node values (the local part's), got {values.shape[0]}", field="values")
    out: torch.Tensor = _WholeRow.apply(values, part)
    return out


def scored_nodes(batch: PackedBatch, nodes: str | torch.Tensor = "trainable") -> torch.Tensor:
    """The nodes to score: ``"trainable"`` (mapped to by a trainable occurrence), ``"all"`` (every non-root node),
    or an explicit index tensor (non-root nodes)."""
    if isinstance(nodes, torch.Tensor):
        idx: torch.Tensor = torch.unique(nodes.to(batch.device, torch.int64))
        if idx.numel() and (idx.min() < 0 or idx.max() >= batch.num_nodes or (batch.parent[idx] < 0).any()):
            raise TreepackError("E_ARG", f"scored nodes must be non-root positions in [0, {batch.num_nodes})", field="nodes")
        return idx
    if nodes == "trainable":
        trainable: torch.Tensor = torch.unique(batch.seq_positions[batch.loss_mask])
        return trainable
    if nodes == "all":
        non_root: torch.Tensor = torch.nonzero(batch.parent >= 0).flatten()
        return non_root
    raise TreepackError("E_ARG", f"expected 'trainable', 'all' or an index tensor, got {nodes!r}", field="nodes")


def _head_and_base(model: torch.nn.Module) -> Any:
    # Hugging Face's API, looked up as such: torch types a Module's unknown attributes as Tensor | Module.
    get_head, prefix = getattr(model, "get_output_embeddings", None), getattr(model, "base_model_prefix", None)
    head = get_head() if get_head is not None else None
    base = getattr(model, prefix, None) if isinstance(prefix, str) else None
    if head is None or base is None:
        raise TreepackError(
            "E_ARG",
            f"{type(model).__name__} is not a Hugging Face causal LM (no output embeddings / base model); "
            "pass hidden states and lm_head instead",
            field="model",
        )
    return head, base


# Most rows a model's embedding has beyond its tokenizer's ids: models pad their vocabulary to a multiple of 64-256
# (Qwen3: 151,669 ids, 151,936 rows; DeepSeek-V3: 128,815 and 129,280) or of 128 per tensor-parallel rank. More
# than this means another model's tokenizer made the ids (Qwen3's 151,669 against Gemma's 262,208 rows).
VOCAB_PADDING = 1024


def check_vocabulary(model: torch.nn.Module, batch: PackedBatch) -> None:
    """Refuses (TreepackError E_INPUT) a batch whose ids the model cannot have been trained on: an id outside its
    embedding, or a header ``vocab_size`` (the packing tokenizer's) above the embedding's rows or more than
    ``VOCAB_PADDING`` below them, the sign of ids made by another model's tokenizer."""
    rows = input_embeddings(model).num_embeddings
    outside = (batch.input_ids < 0) | (batch.input_ids >= rows)
    if bool(outside.any()):
        p = int(torch.argmax(outside.to(torch.int8)))
        raise TreepackError(
            "E_INPUT",
            f"input_ids[{p}] = {int(batch.input_ids[p])} is not a token id of the model (vocabulary size {rows})",
            field="input_ids",
        )
    vocab, name = batch.vocab_size, batch.meta.get("tokenizer", "?")
    if vocab is not None and not 0 <= rows - vocab <= VOCAB_PADDING:
        raise TreepackError(
            "E_INPUT",
            f"the batch was packed with tokenizer {name!r} of {vocab} ids, but {type(model).__name__} embeds {rows} rows: the ids "
            f"come from another model's tokenizer (pack with this model's tokenizer directory, treepack pack --tokenizer DIR)",
            field="vocab_size",
        )


def model_mask(model: torch.nn.Module, batch: PackedBatch, attention: str = "auto") -> Any:
    """The attention_mask a Hugging Face model (unwrapped) takes for ``batch``, after checking the model can be exact
    on it (``check_vocabulary``): under attn_implementation ``"treepack"`` a ``TreeMask`` in mode ``attention``, the
    model prepared for it (``prepare``: recurrent layers run on the tree, windows and sinks per layer); under
    ``"sdpa"``/``"eager"`` the dense tree mask windowed per layer type (``dense_model_mask``), refused for models with
    recurrent layers, which a mask cannot reach."""
    check_vocabulary(model, batch)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "treepack":
        prepare(model)
        return tree_mask(batch, mode=attention)
    if impl in ("sdpa", "eager"):
        check_dense(model)
        return dense_model_mask(model, batch)
    raise TreepackError(
        "E_ARG",
        f"attn_implementation {impl!r} cannot take the tree mask; use 'treepack' (or 'sdpa'/'eager' for small batches)",
        field="attn_implementation",
    )


def _softcap(model: torch.nn.Module | None) -> float | None:
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def packed_logprobs(
    model_or_hidden: torch.nn.Module | torch.Tensor,
    batch: PackedBatch,
    chunk_size: int = 1024,
    entropy: bool = False,
    nodes: str | torch.Tensor = "trainable",
    lm_head: torch.nn.Module | None = None,
    attention: str = "auto",
    temperature: float = 1.0,
    routes: torch.Tensor | None = None,
    router: bool = False,
    image_processor: Any = None,
) -> NodeScores:
    """Logprobs (and entropies) of the scored nodes, differentiable.

    ``model_or_hidden``: a HF causal LM (its base model runs on the packed batch with the tree mask: a ``TreeMask``
    in mode ``attention`` when the model's attn_implementation is ``"treepack"``, else the dense 4-D tree mask for
    ``"sdpa"``/``"eager"``, windowed per layer type: ``dense_model_mask``), or final hidden states [N, D] / [1, N, D]
    with ``lm_head`` (a module mapping D to vocab). Logits are computed in float32 (float64 when the hidden states are
    float64), softcapped by the model's ``final_logit_softcapping`` when it has one, then divided by ``temperature``
    (the order vLLM samples with).

    A mixture-of-experts model replays ``routes`` (int [MoE layers, N, k], the experts the engine chose for each
    node; default ``batch.routes``) instead of its routers' top-k (``treepack.torch.replay_routes``); with routes or
    ``router=True`` the scores carry ``router`` (``RouterOutputs``) for ``load_balancing_loss``.

    On a rank's local part of a row split by context parallelism (``treepack.torch.split_batch``), the model runs
    only the local nodes, exchanging keys/values with the other ranks (``LocalPart.run``); scores are those of the
    local nodes (the context's are NaN). Every rank of the group must call it.
    A vision-language model (Qwen2.5-VL, Qwen3-VL) runs its vision encoder once per image of the batch and its
    language model on the tree with the batch's ``mrope_position_ids`` (``treepack.torch.vision``);
    ``image_processor`` makes the pixel values (default: one built from the header's settings).
    """
    if not isinstance(batch, PackedBatch):
        raise TreepackError("E_ARG", f"expected a PackedBatch (treepack.torch.load_microbatch), got {type(batch).__name__}", field="batch")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {chunk_size!r}", field="chunk_size")
    if not temperature > 0:
        raise TreepackError("E_ARG", f"expected a number > 0, got {temperature!r}", field="temperature")
    model: torch.nn.Module | None = None
    if isinstance(model_or_hidden, torch.nn.Module):
        model = model_or_hidden
        head, base = _head_and_base(model)
        mask = model_mask(model, batch, attention)
        part = batch.context_parallel
        if part is not None:  # a rank's local part: the context's keys/values and hidden rows come from their owners
            if vision_family(model) is not None or has_images(batch):
                raise TreepackError("E_ARG", "a vision-language model under context parallelism is not supported yet", field="batch")
            with routed(model, batch, routes, router) as routing:  # the routers see the local nodes only
                check_context_parallel(model)
                hidden = part.run(base, batch, mask, cp_recurrent)
            moe = None if routing is None else router_outputs(routing, model)
        else:
            with routed(model, batch, routes, router) as routing:
                if vision_family(model) is not None or has_images(batch):
                    hidden = vision_hidden_states(model, batch, mask, image_processor)
                else:
                    out = base(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask, use_cache=False)
                    hidden = out.last_hidden_state[0]
            moe = None if routing is None else router_outputs(routing, model)
    else:
        if batch.context_parallel is not None:
            raise TreepackError(
                "E_ARG",
                "a context-parallel local part needs the model (its forward exchanges keys/values), not hidden states",
                field="batch",
            )
        if routes is not None or router:
            raise TreepackError(
                "E_ARG",
                "routes and router outputs need the model, not its hidden states",
                field="routes" if routes is not None else "router",
            )
        moe = None
        hidden = model_or_hidden
        head = lm_head
        if head is None:
            raise TreepackError("E_ARG", "hidden states need lm_head (the module mapping hidden size to vocabulary)", field="lm_head")
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.dim() != 2 or hidden.shape[0] != batch.num_nodes:
            raise TreepackError(
                "E_ARG", f"expected hidden states [N = {batch.num_nodes}, D], got {list(model_or_hidden.shape)}", field="hidden"
            )
    spec = _LogitSpec(torch.float64 if hidden.dtype == torch.float64 else torch.float32, float(temperature), _softcap(model))

    targets = scored_nodes(batch, nodes).to(hidden.device)
    if batch.context_parallel is not None:  # the context's nodes are scored on the ranks that own them
        targets = targets[targets >= batch.context_parallel.rows]
    parents = batch.parent.to(hidden.device)[targets]
    rows, row_of = torch.unique(parents, return_inverse=True)  # each predicting node once; row_of ascending in rows
    order = torch.argsort(row_of, stable=True)
    targets, row_of = targets[order], row_of[order]
    tokens = batch.input_ids.to(hidden.device)[targets]
    # Chunks of equal size (the last one smaller), none over chunk_size; each chunk's targets are a contiguous range.
    R = rows.numel()
    size = -(-R // -(-R // chunk_size)) if R else 0
    edges = list(range(0, R, size)) + [R] if R else [0]
    bounds = torch.searchsorted(row_of, torch.tensor(edges, device=row_of.device)).tolist()

    if _is_linear(head):
        if tokens.numel() and int(tokens.max()) >= head.weight.shape[0]:
            raise TreepackError(
                "E_INPUT",
                f"token id {int(tokens.max())} is not below the LM head's vocabulary size {head.weight.shape[0]}",
                field="input_ids",
            )
        lp, row_entropy = _LinearHeadScores.apply(
            hidden.index_select(0, rows), head.weight, head.bias, row_of, tokens, edges, bounds, spec, entropy
        )
        scored = torch.stack([lp, row_entropy[row_of]]) if entropy else lp[None]
    else:
        scored = _module_head_scores(head, hidden, rows, row_of, tokens, edges, bounds, spec, entropy)
    k = 2 if entropy else 1
    full = torch.full((k, batch.num_nodes), float("nan"), dtype=spec.dtype, device=hidden.device)
    full = full.index_put((torch.arange(k, device=hidden.device)[:, None], targets[None, :]), scored)
    return NodeScores(full[0], full[1] if entropy else None, torch.sort(targets).values, moe)


@contextlib.contextmanager
def routed(model: torch.nn.Module, batch: PackedBatch, routes: torch.Tensor | None, router: bool) -> Iterator[Any]:
    """``replay_routes`` over one packed forward when there are routes (given, or the batch's) or router outputs are
    asked for; else nothing (yields None). On a context-parallel local part the forward runs its local nodes: they
    replay the local rows of the routes ([MoE layers, A + n, k], the context's first)."""
    routes = batch.routes if routes is None else routes
    if routes is None and not router:
        yield None
        return
    A = 0 if batch.context_parallel is None else batch.context_parallel.rows
    if routes is not None and A:
        if not (isinstance(routes, torch.Tensor) and routes.dim() == 3 and routes.shape[1] == batch.num_nodes):
            got = list(routes.shape) if isinstance(routes, torch.Tensor) else type(routes).__name__
            raise TreepackError(
                "E_INPUT",
                f"expected routes [MoE layers, {batch.num_nodes}, k] (the local part's nodes, context first), got {got}",
                field="routes",
            )
        routes = routes[:, A:]
    with replay_routes(model, routes, tokens=batch.num_nodes - A) as routing:
        yield routing


class _LogitSpec(NamedTuple):
    dtype: torch.dtype  # of the logits: float32, or float64 for float64 hidden states
    temperature: float
    cap: float | None  # final_logit_softcapping


def _finish_logits(z: torch.Tensor, spec: _LogitSpec, inplace: bool) -> torch.Tensor:
    """The head's output as the sampler saw it: softcapped, then divided by the temperature (vLLM's order)."""
    if spec.cap is not None:
        z = z.div_(spec.cap).tanh_().mul_(spec.cap) if inplace else spec.cap * torch.tanh(z / spec.cap)
    if spec.temperature != 1.0:
        z = z.div_(spec.temperature) if inplace else z / spec.temperature
    return z


def _is_linear(head: Any) -> bool:
    """A plain linear layer in floating point, which _LinearHeadScores can run from its weight and bias; a subclass
    with its own forward (quantized, adapters) keeps its own."""
    return isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward and head.weight.is_floating_point()


class _Scratch:
    """[rows, vocab] buffers, each allocated once at the first (largest) chunk and reused by the next: on CPU every
    fresh buffer of this size is a new mapping whose pages the kernel zero-fills on first touch."""

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """A [rows, cols] view, of like's dtype and device."""
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = like.new_empty((rows, cols))
        return buf[:rows]


def _linear_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: _LogitSpec, scratch: _Scratch) -> torch.Tensor:
    """The finished logits of rows h, written into scratch's "z" buffer when the head computes in spec.dtype."""
    if weight.dtype != spec.dtype:  # e.g. a bf16 head: its output is cast, as head(h).to(float32) would be
        z = torch.nn.functional.linear(h, weight, bias).to(spec.dtype)
    else:
        z = scratch.get("z", weight, h.shape[0], weight.shape[0])
        torch.mm(h, weight.t(), out=z) if bias is None else torch.addmm(bias, h, weight.t(), out=z)
    return _finish_logits(z, spec, inplace=True)


class _LinearHeadScores(torch.autograd.Function):
    """Logprobs [K] of the targets and entropies [R] of the rows (empty without entropy), from the rows' hidden states
    h [R, D] through weight [V, D] (and bias); row_of [K] (ascending) is each target's row, tokens [K] its token;
    chunk c covers rows edges[c]:edges[c+1] and targets bounds[c]:bounds[c+1].

    Backward recomputes each chunk's logits (one more matmul per row) rather than keeping them, so nothing of
    [rows, vocab] lives from forward to backward, and backward holds one chunk buffer (two with entropy). Keeping a
    lone chunk's probabilities instead measured no faster on a shared 2-core CPU (N = 1k, 73% scored, hidden 256:
    9.6 s kept, 8.6 s recomputed) and held 0.4 GiB more: there, fresh [rows, vocab] pages cost about what the saved
    matmul does."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        row_of: torch.Tensor,
        tokens: torch.Tensor,
        edges: list[int],
        bounds: list[int],
        spec: _LogitSpec,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        R = h.shape[0]
        lp = h.new_empty(tokens.shape[0], dtype=spec.dtype)
        lse = h.new_empty(R, dtype=spec.dtype)
        row_entropy = h.new_empty(R if entropy else 0, dtype=spec.dtype)
        scratch = _Scratch()
        for c in range(len(edges) - 1):
            a, b, lo, hi = edges[c], edges[c + 1], bounds[c], bounds[c + 1]
            z = _linear_logits(h[a:b], weight, bias, spec, scratch)
            m = z.amax(-1)
            y = z.sub_(m[:, None])
            picked = y[row_of[lo:hi] - a, tokens[lo:hi]]
            if entropy:  # needs y and exp(y) together: exponentiate into a second buffer
                e = torch.exp(y, out=scratch.get("e", y, *y.shape))
                s = e.sum(-1)
                log_s = s.log()
                row_entropy[a:b] = log_s - e.mul_(y).sum(-1).div_(s)  # -sum p log p, with p = e / s, log p = y - log s
            else:
                log_s = y.exp_().sum(-1).log_()
            lse[a:b] = m + log_s
            lp[lo:hi] = picked - log_s[row_of[lo:hi] - a]
        ctx.save_for_backward(h, weight, bias, row_of, tokens, lse, row_entropy)
        ctx.chunks, ctx.spec = (edges, bounds), spec
        ctx.mark_non_differentiable(*([] if entropy else [row_entropy]))
        return lp, row_entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, row_of, tokens, lse, row_entropy = ctx.saved_tensors
        (edges, bounds), spec = ctx.chunks, ctx.spec
        g_lp = g_lp if g_lp is not None else lse.new_zeros(tokens.shape[0])
        g_row = lse.new_zeros(lse.shape[0]).index_add_(0, row_of, g_lp)  # a row's logprob gradients, summed
        g_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        g_w = (
            (torch.empty_like if len(edges) > 1 else torch.zeros_like)(weight) if ctx.needs_input_grad[1] else None
        )  # the first chunk writes it
        g_b = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        scratch = _Scratch()
        for c in range(len(edges) - 1):
            a, b, lo, hi = edges[c], edges[c + 1], bounds[c], bounds[c + 1]
            p = _linear_logits(h[a:b], weight, bias, spec, scratch).sub_(lse[a:b, None]).exp_()
            # d softcap / d head output = (1 - tanh^2) / T, tanh read back from the finished logits (log p + lse); a p
            # that underflowed to 0 reads as -inf: clamped, its factor is 0, as its gradient is.
            dcap = None
            if spec.cap is not None:
                t = torch.log(p, out=scratch.get("cap", p, *p.shape)).add_(lse[a:b, None]).mul_(spec.temperature / spec.cap).clamp_(-1, 1)
                dcap = t.square_().neg_().add_(1)
            # d/dz of the row's sum g log p[token] = onehot(token) * g - p * (the row's sum of g); of g_H H,
            # -p * g_H * (log p + H) = -g_H * p log p - g_H H p.
            if g_entropy is not None and g_entropy.numel():
                g = torch.special.xlogy(p, p, out=scratch.get("e", p, *p.shape)).mul_(g_entropy[a:b, None].neg())
                g.addcmul_(p, (g_row[a:b] + g_entropy[a:b] * row_entropy[a:b])[:, None], value=-1)
            else:
                g = p.mul_(g_row[a:b, None].neg())
            g.index_put_((row_of[lo:hi] - a, tokens[lo:hi]), g_lp[lo:hi], accumulate=True)
            if dcap is not None:
                g.mul_(dcap)
            if spec.temperature != 1.0:
                g.div_(spec.temperature)
            g = g.to(weight.dtype)
            if g_h is not None:
                torch.mm(g, weight, out=g_h[a:b])
            if g_w is not None:
                g_w.addmm_(g.t(), h[a:b]) if c else torch.mm(g.t(), h[a:b], out=g_w)
            if g_b is not None:
                g_b.add_(g.sum(0))
        return g_h, g_w, g_b, None, None, None, None, None, None


def _module_head_scores(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    row_of: torch.Tensor,
    tokens: torch.Tensor,
    edges: list[int],
    bounds: list[int],
    spec: _LogitSpec,
    entropy: bool,
) -> torch.Tensor:
    """[1 or 2, K] logprobs (and entropies) of the targets through any head module, by autograd."""

    def chunk(h: torch.Tensor, local_row: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        logits = _finish_logits(head(h).to(spec.dtype), spec, inplace=False)
        if tok.numel() and int(tok.max()) >= logits.shape[-1]:
            raise TreepackError(
                "E_INPUT", f"token id {int(tok.max())} is not below the LM head's vocabulary size {logits.shape[-1]}", field="input_ids"
            )
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits[local_row, tok] - lse[local_row]
        if not entropy:
            return lp[None]
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return torch.stack([lp, ent[local_row]])

    # With several chunks, checkpointing keeps one chunk's logits alive at a time; a single chunk peaks the same
    # either way, so it is not recomputed.
    several = len(edges) > 2 and torch.is_grad_enabled()
    parts = []
    for c in range(len(edges) - 1):
        a, b, lo, hi = edges[c], edges[c + 1], bounds[c], bounds[c + 1]
        args = (hidden[rows[a:b]], row_of[lo:hi] - a, tokens[lo:hi])
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if several else chunk(*args))
    return torch.cat(parts, dim=1) if parts else hidden.new_zeros((2 if entropy else 1, 0), dtype=spec.dtype)
