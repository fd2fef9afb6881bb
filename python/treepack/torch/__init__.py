"""treepack's trainer side in PyTorch: packed micro-batches as tensors, tree attention for Hugging Face models,
node logprobs without full logits, and the packed RL loss as an autograd function.

    >>> import treepack.torch as tpt                # registers attn_implementation="treepack" with transformers
    >>> batch = tpt.load_microbatch(path, device="cuda")
    >>> lp = tpt.packed_logprobs(model, batch).logprobs           # [N], at the nodes that predict trainable tokens
    >>> loss, metrics = tpt.packed_loss(lp, batch, {"clip_low": 0.2, "clip_high": 0.28})
    >>> loss.backward()
    >>> batch, layout = tpt.from_padded(ids, attn, response_mask=mask)   # a trainer's rows, packed
    >>> per_token = layout.to_padded(tpt.forward_logprobs(wrapped_model, batch).logprobs)  # [B, R] back
"""

from .attention import TreeMask, attend, dense_tree_mask, executed_tiles, register, tree_attention, tree_mask
from ..microbatch import read_manifest
from .batch import PackedBatch, PackedDataset, from_microbatch, load_microbatch, naive_batch
from .logprobs import NodeScores, gather_occurrences, packed_logprobs, scored_nodes
from .forward import forward_logprobs, model_tree_mask, unwrap
from .rows import RowLayout, from_jagged, from_padded, padded_rows
from .loss import METRICS, PackedLoss, packed_loss

__all__ = [
    "METRICS",
    "NodeScores",
    "PackedLoss",
    "gather_occurrences",
    "packed_logprobs",
    "packed_loss",
    "scored_nodes",
    "PackedBatch",
    "PackedDataset",
    "RowLayout",
    "forward_logprobs",
    "from_jagged",
    "from_padded",
    "model_tree_mask",
    "padded_rows",
    "unwrap",
    "TreeMask",
    "attend",
    "dense_tree_mask",
    "executed_tiles",
    "from_microbatch",
    "load_microbatch",
    "naive_batch",
    "read_manifest",
    "register",
    "tree_attention",
    "tree_mask",
]
