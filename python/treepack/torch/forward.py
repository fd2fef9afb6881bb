"""Node logprobs through a wrapped model's own ``forward``: DDP, FSDP (1 and 2), PEFT/LoRA and accelerate
wrappers run as they expect (gradient-sync preparation, parameter gathering, adapters), and the LM head runs only at
the rows that predict a scored token (``logits_to_keep`` as an index tensor). FSDP is tested over two gloo
processes on CPU (python/tests/trainer/test_fsdp.py: gradients equal the unpacked single-process run's); a
DeepSpeed engine is unwrapped the same way (``.module``), but no test runs one (DeepSpeed does not install on
treepack's CI): untested.

``packed_logprobs`` calls the base model and the head's weight itself (chunked, no [N, vocab] logits); this path
instead gets ``[rows, vocab]`` logits from the model, one row per node that predicts a scored token (a branch
point's row serves all its children), so it needs that much memory for them at once.

    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> from treepack.torch import from_padded, packed_logprobs
    >>> ddp_model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")   # or wrapped
    >>> input_ids = torch.tensor([[0, 2, 3, 6, 7], [2, 3, 4, 8, 9]])
    >>> batch, layout = from_padded(input_ids, (input_ids != 0).long(), response_mask=torch.ones(2, 2))
    >>> scores = forward_logprobs(ddp_model, batch, temperature=0.7, entropy=True)
    >>> per_token = layout.to_padded(scores.logprobs)
    >>> per_token.shape, layout.to_padded(scores.entropy).shape
    (torch.Size([2, 2]), torch.Size([2, 2]))
    >>> same = packed_logprobs(ddp_model, batch, temperature=0.7).logprobs   # the chunked path: the same values
    >>> torch.allclose(scores.logprobs, same, atol=1e-5, equal_nan=True)
    True
"""

from __future__ import annotations

from typing import Any

import torch

from ..microbatch import TreepackError
from .batch import PackedBatch
from .logprobs import NodeScores, model_mask, routed, scored_nodes
from .moe import router_outputs
from .vision import refuse_images, vision_family
from .wrappers import unwrap


def model_tree_mask(model: torch.nn.Module, batch: PackedBatch, attention: str = "auto") -> Any:
    """The attention_mask a (wrapped) model takes for ``batch``: ``model_mask`` of the Hugging Face model inside the
    wrapper (a ``TreeMask`` under ``"treepack"``, hybrid layers prepared; the dense mask windowed per layer type
    under ``"sdpa"``/``"eager"``), with the same refusals as ``packed_logprobs``."""
    return model_mask(unwrap(model), batch, attention)


def forward_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    nodes: str | torch.Tensor = "trainable",
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = True,
    attention: str = "auto",
    routes: torch.Tensor | None = None,
    router: bool = False,
) -> NodeScores:
    """Logprobs (and entropies) of the scored nodes (``scored_nodes``), through ``model(...)`` itself: the wrapper
    (or the plain HF causal LM) gets ``input_ids``, ``position_ids``, the tree mask (``model_tree_mask``) and
    ``logits_to_keep=<rows>``. Logits are float32 (float64 for a float64 model) divided by ``temperature``, as
    TRL and vLLM apply it (a softcapping model softcaps inside its forward). ``entropy_grad=False`` computes the
    entropies without autograd (they feed a mask or a log only). NaN at nodes not scored, as ``packed_logprobs``.
    ``routes`` / ``router``: a MoE model's routing replay and router outputs, as ``packed_logprobs``. A
    vision-language model is refused (its forward would encode the images and place them by token id, not by
    fill): ``packed_logprobs`` runs it.
    """
    if not isinstance(batch, PackedBatch):
        raise TreepackError("E_ARG", f"expected a PackedBatch, got {type(batch).__name__}", field="batch")
    if vision_family(unwrap(model)) is not None:
        raise TreepackError(
            "E_ARG",
            f"forward_logprobs does not run {type(unwrap(model)).__name__} (a vision-language model): use packed_logprobs",
            field="model",
        )
    refuse_images(batch, "forward_logprobs")
    if not temperature > 0:
        raise TreepackError("E_ARG", f"expected a number > 0, got {temperature!r}", field="temperature")
    if batch.context_parallel is not None:
        raise TreepackError(
            "E_ARG",
            "a context-parallel local part runs through packed_logprobs (the wrapper's forward cannot exchange keys/values)",
            field="batch",
        )
    targets = scored_nodes(batch, nodes)
    rows, row_of = torch.unique(batch.parent[targets], return_inverse=True)
    mask = model_tree_mask(model, batch, attention)
    with routed(model, batch, routes, router) as routing:
        out = model(
            input_ids=batch.input_ids[None],
            position_ids=batch.position_ids[None],
            attention_mask=mask,
            logits_to_keep=rows,
            use_cache=False,
        )
    moe = None if routing is None else router_outputs(routing, model)
    logits = out.logits[0]
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp = logits.log_softmax(-1)
    picked = logp[row_of, batch.input_ids[targets]]
    full = torch.full((batch.num_nodes,), float("nan"), dtype=logp.dtype, device=logp.device)
    lp = full.index_put((targets,), picked)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            row_entropy = -(logp.exp() * logp).sum(-1)
            ent = full.index_put((targets,), row_entropy[row_of])
    return NodeScores(lp, ent, targets, moe)
