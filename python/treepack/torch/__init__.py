"""treepack's trainer side in PyTorch: packed micro-batches as tensors, tree attention for Hugging Face models,
node logprobs without full logits, and the packed RL loss as an autograd function.

    >>> import treepack.torch as tpt                # registers attn_implementation="treepack" with transformers
    >>> batch = tpt.load_microbatch(path, device="cuda")
    >>> lp = tpt.packed_logprobs(model, batch).logprobs           # [N], at the nodes that predict trainable tokens
    >>> loss, metrics = tpt.packed_loss(lp, batch, {"clip_low": 0.2, "clip_high": 0.28})
    >>> loss.backward()
"""

from .attention import TreeMask, attend, dense_model_mask, dense_tree_mask, executed_tiles, layer_windows, register, tree_attention, tree_mask, windowed
from ..microbatch import read_manifest
from .batch import PackedBatch, PackedDataset, from_microbatch, load_microbatch, naive_batch
from .logprobs import NodeScores, check_vocabulary, gather_occurrences, packed_logprobs, scored_nodes
from .loss import METRICS, PackedLoss, packed_loss
from .stepplan import StepOp, StepPlanRunner, StepResult, check_attention_only, run_step_plan, step_op

__all__ = [
    "METRICS",
    "NodeScores",
    "check_vocabulary",
    "PackedLoss",
    "gather_occurrences",
    "packed_logprobs",
    "packed_loss",
    "scored_nodes",
    "PackedBatch",
    "PackedDataset",
    "TreeMask",
    "attend",
    "dense_model_mask",
    "dense_tree_mask",
    "executed_tiles",
    "layer_windows",
    "from_microbatch",
    "load_microbatch",
    "naive_batch",
    "read_manifest",
    "run_step_plan",
    "step_op",
    "StepOp",
    "StepPlanRunner",
    "StepResult",
    "check_attention_only",
    "register",
    "tree_attention",
    "tree_mask",
    "windowed",
]
