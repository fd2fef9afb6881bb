"""treepack's trainer side in PyTorch: packed micro-batches as tensors, tree attention for Hugging Face models,
node logprobs without full logits, and the packed RL loss in torch under autograd.

    >>> import torch, treepack, treepack.torch as tpt   # registers attn_implementation="treepack" with transformers
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> batch = tpt.load_microbatch(treepack.list_microbatches("packed")[0])   # device="cuda" on a GPU
    >>> lp = tpt.packed_logprobs(model, batch).logprobs           # [N], at the nodes that predict trainable tokens
    >>> lp.isnan().tolist()                                       # NaN elsewhere: here the shared prompt [2, 3, 4, 5]
    [True, True, True, True, False, False, False, False, False, False]
    >>> loss, metrics = tpt.packed_loss(lp, batch, {"clip_low": 0.2, "clip_high": 0.28})
    >>> loss.backward()
    >>> metrics["trainable_tokens"], model.lm_head.weight.grad.abs().sum().item() > 0
    (6, True)
    >>> ids = torch.tensor([[0, 0, 2, 3, 6, 7], [2, 3, 4, 5, 8, 9]])   # a trainer's rows: left padding, responses of 2
    >>> batch, layout = tpt.from_padded(ids, (ids != 0).long(), response_length=2)   # packed: the rows share [2, 3]
    >>> batch.num_nodes
    8
    >>> per_token = layout.to_padded(tpt.forward_logprobs(model, batch).logprobs)  # [B, R] back
    >>> per_token.shape
    torch.Size([2, 2])

Mixture-of-experts models: ``packed_logprobs(model, batch, routes=...)`` replays the experts an inference engine chose
(routing replay) and ``load_balancing_loss`` counts the router's auxiliary loss per logical occurrence
(``treepack.torch.moe``).

Hybrid models (Gated DeltaNet, KDA, Mamba2 layers): ``prepare(model)`` makes their recurrent layers run on the tree
(packed_logprobs calls it); any token-mixing layer it cannot run is refused by name.

Vision-language models (Qwen2.5-VL, Qwen3-VL): ``packed_logprobs`` runs the vision encoder once per distinct image of
a micro-batch and scatters its embeddings at the batch's image fills, with the 3-D rotary positions it carries
(``treepack.torch.vision``).
"""

from ..microbatch import read_manifest
from .attention import (
    TreeMask,
    attend,
    dense_model_mask,
    dense_tree_mask,
    executed_tiles,
    layer_windows,
    register,
    tree_attention,
    tree_mask,
    windowed,
)
from .batch import PackedBatch, PackedDataset, from_microbatch, load_microbatch, naive_batch
from .compiled_flex import flex_compilations, ladder_length
from .context_parallel import ContextParallel, LocalPart, balanced_bounds, reduce_gradients, split_batch
from .forward import forward_logprobs, model_tree_mask
from .logprobs import NodeScores, check_vocabulary, gather_occurrences, packed_logprobs, scored_nodes, whole_row
from .loss import METRICS, PackedLoss, metrics_to_floats, packed_loss
from .models import LAYERS, prepare
from .moe import ROUTERS, RouterOutputs, Routing, load_balancing_loss, occurrence_weights, pack_routed, replay_routes
from .rows import RowLayout, from_jagged, from_padded, padded_rows
from .segments import Segments, radix_segments, segments_of
from .stepplan import RECURRENT, StepOp, StepPlanRunner, StepResult, check_model, run_step_plan, step_op, sync_gradients
from .wrappers import unwrap

__all__ = [
    "ContextParallel",
    "LocalPart",
    "balanced_bounds",
    "reduce_gradients",
    "split_batch",
    "LAYERS",
    "ROUTERS",
    "RouterOutputs",
    "Routing",
    "load_balancing_loss",
    "occurrence_weights",
    "pack_routed",
    "replay_routes",
    "METRICS",
    "NodeScores",
    "check_vocabulary",
    "PackedLoss",
    "gather_occurrences",
    "packed_logprobs",
    "packed_loss",
    "metrics_to_floats",
    "scored_nodes",
    "whole_row",
    "segments_of",
    "PackedBatch",
    "PackedDataset",
    "Segments",
    "RowLayout",
    "forward_logprobs",
    "from_jagged",
    "from_padded",
    "model_tree_mask",
    "padded_rows",
    "unwrap",
    "TreeMask",
    "attend",
    "dense_model_mask",
    "dense_tree_mask",
    "executed_tiles",
    "flex_compilations",
    "ladder_length",
    "layer_windows",
    "from_microbatch",
    "load_microbatch",
    "naive_batch",
    "prepare",
    "radix_segments",
    "read_manifest",
    "run_step_plan",
    "sync_gradients",
    "step_op",
    "StepOp",
    "StepPlanRunner",
    "StepResult",
    "check_model",
    "RECURRENT",
    "register",
    "tree_attention",
    "tree_mask",
    "windowed",
]
