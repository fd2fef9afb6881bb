"""Node logprobs of a packed forward without [N, vocab] logits.

Node p's logprob is ``log_softmax(logits[parent[p]])[input_ids[p]]`` (README "The packed micro-batch"), so the LM
head is needed only at the parents of the nodes that are scored: by default the nodes some trainable occurrence maps
to. Those parents (a branch point's row serves all its children) go through the head in chunks of ``chunk_size``
rows, each under activation checkpointing when there are several, so at most one chunk's logits exist at a time,
forward or backward.

    >>> scores = packed_logprobs(model, batch, entropy=True)     # runs the model packed (attn "treepack" or sdpa)
    >>> scores.logprobs                                          # [N]; NaN at nodes not scored
    >>> per_token = gather_occurrences(scores.logprobs, batch)   # [M], sequence i's token t at seq_offsets[i] + t
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils.checkpoint import checkpoint

from ..microbatch import TreepackError
from .attention import dense_tree_mask, tree_mask
from .batch import PackedBatch


class NodeScores(NamedTuple):
    logprobs: torch.Tensor  # float32 (or the hidden states' dtype if float64) [N]; NaN where not scored
    entropy: Optional[torch.Tensor]  # [N], the entropy of the distribution that predicts node p; NaN where not scored
    nodes: torch.Tensor  # int64 [K], the scored nodes, ascending


def gather_occurrences(node_values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-occurrence values [M] from per-node values [N] (the unmerge); its backward sums each node's occurrences."""
    if node_values.shape[0] != batch.num_nodes:
        raise TreepackError("E_ARG", f"expected {batch.num_nodes} node values, got {node_values.shape[0]}", field="node_values")
    return node_values.index_select(0, batch.seq_positions.to(node_values.device))


def scored_nodes(batch: PackedBatch, nodes: Union[str, torch.Tensor] = "trainable") -> torch.Tensor:
    """The nodes to score: ``"trainable"`` (mapped to by a trainable occurrence), ``"all"`` (every non-root node),
    or an explicit index tensor (non-root nodes)."""
    if isinstance(nodes, torch.Tensor):
        idx = torch.unique(nodes.to(batch.device, torch.int64))
        if idx.numel() and (idx.min() < 0 or idx.max() >= batch.num_nodes or (batch.parent[idx] < 0).any()):
            raise TreepackError("E_ARG", f"scored nodes must be non-root positions in [0, {batch.num_nodes})", field="nodes")
        return idx
    if nodes == "trainable":
        return torch.unique(batch.seq_positions[batch.loss_mask])
    if nodes == "all":
        return torch.nonzero(batch.parent >= 0).flatten()
    raise TreepackError("E_ARG", f"expected 'trainable', 'all' or an index tensor, got {nodes!r}", field="nodes")


def _head_and_base(model: torch.nn.Module) -> Any:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, model.base_model_prefix, None) if hasattr(model, "base_model_prefix") else None
    if head is None or base is None:
        raise TreepackError("E_ARG", f"{type(model).__name__} is not a Hugging Face causal LM (no output embeddings / base model); pass hidden states and lm_head instead", field="model")
    return head, base


def _softcap(model: Optional[torch.nn.Module]) -> Optional[float]:
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def packed_logprobs(
    model_or_hidden: Union[torch.nn.Module, torch.Tensor],
    batch: PackedBatch,
    chunk_size: int = 1024,
    entropy: bool = False,
    nodes: Union[str, torch.Tensor] = "trainable",
    lm_head: Optional[torch.nn.Module] = None,
    attention: str = "auto",
    temperature: float = 1.0,
) -> NodeScores:
    """Logprobs (and entropies) of the scored nodes, differentiable.

    ``model_or_hidden``: a HF causal LM (its base model runs on the packed batch with the tree mask: a ``TreeMask``
    in mode ``attention`` when the model's attn_implementation is ``"treepack"``, else a dense 4-D bool mask for
    ``"sdpa"``/``"eager"``), or final hidden states [N, D] / [1, N, D] with ``lm_head`` (a module mapping D to vocab).
    Logits are computed in float32 (float64 when the hidden states are float64), divided by ``temperature``, with
    the model's ``final_logit_softcapping`` when it has one.
    """
    if not isinstance(batch, PackedBatch):
        raise TreepackError("E_ARG", f"expected a PackedBatch (treepack.torch.load_microbatch), got {type(batch).__name__}", field="batch")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise TreepackError("E_ARG", f"expected an integer >= 1, got {chunk_size!r}", field="chunk_size")
    if not temperature > 0:
        raise TreepackError("E_ARG", f"expected a number > 0, got {temperature!r}", field="temperature")
    model = model_or_hidden if isinstance(model_or_hidden, torch.nn.Module) else None
    if model is not None:
        head, base = _head_and_base(model)
        vocab_in = model.get_input_embeddings().num_embeddings
        outside = (batch.input_ids < 0) | (batch.input_ids >= vocab_in)
        if bool(outside.any()):
            p = int(torch.argmax(outside.to(torch.int8)))
            raise TreepackError("E_INPUT", f"input_ids[{p}] = {int(batch.input_ids[p])} is not a token id of the model (vocabulary size {vocab_in})", field="input_ids")
        impl = getattr(model.config, "_attn_implementation", None)
        if impl == "treepack":
            mask: Any = tree_mask(batch, mode=attention)
        elif impl in ("sdpa", "eager"):
            mask = dense_tree_mask(batch.subtree_end)[None, None]
        else:
            raise TreepackError("E_ARG", f"attn_implementation {impl!r} cannot take the tree mask; use 'treepack' (or 'sdpa'/'eager' for small batches)", field="attn_implementation")
        out = base(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask, use_cache=False)
        hidden = out.last_hidden_state[0]
    else:
        hidden = model_or_hidden
        head = lm_head
        if head is None:
            raise TreepackError("E_ARG", "hidden states need lm_head (the module mapping hidden size to vocabulary)", field="lm_head")
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.dim() != 2 or hidden.shape[0] != batch.num_nodes:
            raise TreepackError("E_ARG", f"expected hidden states [N = {batch.num_nodes}, D], got {list(model_or_hidden.shape)}", field="hidden")
    cap = _softcap(model)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32

    targets = scored_nodes(batch, nodes).to(hidden.device)
    parents = batch.parent.to(hidden.device)[targets]
    rows, row_of = torch.unique(parents, return_inverse=True)  # each predicting node once; row_of ascending in rows
    order = torch.argsort(row_of, stable=True)
    targets, row_of = targets[order], row_of[order]
    tokens = batch.input_ids.to(hidden.device)[targets]

    def chunk(h: torch.Tensor, local_row: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        logits = head(h).to(dtype)
        if temperature != 1.0:
            logits = logits / temperature
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        if tok.numel() and int(tok.max()) >= logits.shape[-1]:
            raise TreepackError("E_INPUT", f"token id {int(tok.max())} is not below the LM head's vocabulary size {logits.shape[-1]}", field="input_ids")
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits[local_row, tok] - lse[local_row]
        if not entropy:
            return lp[None]
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return torch.stack([lp, ent[local_row]])

    parts = []
    bounds = torch.searchsorted(row_of, torch.arange(0, rows.numel() + chunk_size, chunk_size, device=row_of.device)).tolist()
    for c, a in enumerate(range(0, rows.numel(), chunk_size)):
        b = min(a + chunk_size, rows.numel())
        lo, hi = bounds[c], bounds[c + 1]
        args = (hidden[rows[a:b]], row_of[lo:hi] - a, tokens[lo:hi])
        # With several chunks, checkpointing keeps one chunk's logits alive at a time; a single chunk peaks the same
        # either way, so it is not recomputed.
        several = rows.numel() > chunk_size
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if several and torch.is_grad_enabled() else chunk(*args))
    k = 2 if entropy else 1
    scored = torch.cat(parts, dim=1) if parts else hidden.new_zeros((k, 0), dtype=dtype)
    full = torch.full((k, batch.num_nodes), float("nan"), dtype=dtype, device=hidden.device)
    full = full.index_put((torch.arange(k, device=hidden.device)[:, None], targets[None, :]), scored)
    return NodeScores(full[0], full[1] if entropy else None, torch.sort(targets).values)
