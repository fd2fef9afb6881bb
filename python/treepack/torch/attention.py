"""Tree attention for any Hugging Face causal LM: the ``"treepack"`` attn_implementation.

    >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="treepack")
    >>> mask = tree_mask(batch)                                  # from subtree_end; no --masks needed
    >>> out = model(batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask)

Query q attends to key k iff ``k <= q < subtree_end[k]``. ``tree_mask`` builds a ``TreeMask``: a FlexAttention
``BlockMask`` (block arrays computed in Python from ``subtree_end``, ``flex.block_arrays_from_tree``) that also
carries ``subtree_end`` and how to attend:

- ``"flex"``: ``flex_attention`` with the BlockMask (compiled on CUDA; on CPU forward only, torch has no backward);
- ``"dense"``: SDPA with the dense bool [N, N] mask, built once per mask (O(N²) memory: small batches);
- ``"block"``: block-sparse SDPA on any device, with backward: query blocks are grouped by how many kv blocks they
  see, and each group runs SDPA over its gathered kv blocks with their partial masks, in calls of at most
  ``PLAN_TILES`` tiles, so the work and memory are O(visible blocks · B²), not N² (``executed_tiles`` counts them);
- ``"auto"`` (default): flex on CUDA, block elsewhere.

A HF model passes a 4-D BlockMask straight to its attention function, so the TreeMask reaches ``tree_attention``
unchanged; any mask other than a TreeMask is refused there (TreepackError), never silently run causal.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..flex import block_arrays_from_tree, tree_mask_mod
from ..microbatch import TreepackError

MODES = ("auto", "flex", "dense", "block")


class NotTreeAware(TreepackError, AttributeError):
    """A TreeMask reached code that is not tree-aware; an AttributeError too, so ``hasattr`` probes stay False."""


class TreeMask(BlockMask):
    """A BlockMask of the tree rule that also knows ``subtree_end`` and its attention ``mode``; the block-sparse and
    dense paths cache their gather plans and masks on it, so every layer of a forward shares them."""

    subtree_end: torch.Tensor
    mode: str
    _cache: Dict[Any, Any]

    @property
    def ndim(self) -> int:
        # transformers reads a mask's ndim to build its recurrent layers' padding mask: a TreeMask gets there only in
        # a hybrid model that treepack.torch.prepare has not made tree-aware (its hook hands the layers the TreeMask).
        raise NotTreeAware("E_ARG", "this model has recurrent layers: call treepack.torch.prepare(model) before passing it a TreeMask "
                           "(packed_logprobs does)", field="attention_mask")


def _subtree_end_of(batch_or_subtree_end: Any) -> torch.Tensor:
    se = getattr(batch_or_subtree_end, "subtree_end", batch_or_subtree_end)
    if isinstance(se, np.ndarray):
        se = torch.from_numpy(np.asarray(se, dtype=np.int64))
    if not isinstance(se, torch.Tensor) or se.dim() != 1 or se.dtype.is_floating_point or se.dtype == torch.bool:
        raise TreepackError("E_ARG", f"expected a 1-D integer tensor, got {type(se).__name__}", field="subtree_end")
    return se


def tree_mask(
    batch_or_subtree_end: Any,
    mode: str = "auto",
    block_size: int = 128,
    device: Optional[Union[str, torch.device]] = None,
) -> TreeMask:
    """The TreeMask of a ``PackedBatch`` (or a ``subtree_end`` tensor / array) on ``device`` (the tensor's by
    default). ``block_size`` is the BlockMask's tile (FlexAttention wants a multiple of 128 on GPU; the block-sparse
    path runs any size)."""
    if mode not in MODES:
        raise TreepackError("E_ARG", f"expected one of {', '.join(MODES)}, got {mode!r}", field="mode")
    se = _subtree_end_of(batch_or_subtree_end)
    dev = torch.device(device) if device is not None else se.device
    arrays = block_arrays_from_tree(se.detach().cpu().numpy(), block_size)
    n = int(se.shape[0])
    se = se.to(dev, torch.int64)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(dev)[None, None]

    mask = TreeMask.from_kv_blocks(
        t(arrays.kv_num_blocks), t(arrays.kv_indices), t(arrays.full_kv_num_blocks), t(arrays.full_kv_indices),
        BLOCK_SIZE=arrays.block_size, mask_mod=tree_mask_mod(se), seq_lengths=(n, n),
    )
    mask.subtree_end = se
    mask.mode = ("flex" if dev.type == "cuda" else "block") if mode == "auto" else mode
    mask._cache = {}
    return mask


def dense_tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """bool [N, N], row = query (O(N²)): the reference and the ``"dense"`` mode's mask."""
    n = subtree_end.shape[0]
    ar = torch.arange(n, device=subtree_end.device)
    return (ar[None, :] <= ar[:, None]) & (ar[:, None] < subtree_end[None, :])


# Most B×B tiles one SDPA call of the block path computes. Each call gathers its rows' kv blocks and a G × B × K·B mask
# (SDPA makes it float): at 256 tiles of 128² that is ~16 MB, where one call per group reached hundreds of MB in a
# 15k-token micro-batch and ran ~1.5× slower per tile than small ones (measured on CPU; the cost was then not linear
# in the tiles, as the bench's cost model assumes).
PLAN_TILES = 256


def _plan_chunks(mask: TreeMask) -> List[Tuple[torch.Tensor, int]]:
    """The block path's SDPA calls: (query block ids [G], K) per call, where K is the most kv blocks a row of the call
    sees. Rows are grouped by that count rounded up to a power of two (at most 2× padding), and a group is split so
    that G·K ≤ PLAN_TILES (a row alone may exceed it)."""
    num = (mask.kv_num_blocks[0, 0] + mask.full_kv_num_blocks[0, 0]).cpu()
    if num.numel() == 0:
        return []
    bucket = torch.ceil(torch.log2(num.clamp(min=1).double())).long()
    chunks = []
    for b in torch.unique(bucket).tolist():
        rows = torch.nonzero(bucket == b).flatten()
        K = int(num[rows].max())
        step = max(1, PLAN_TILES // K)
        chunks.extend((rows[i : i + step], int(num[rows[i : i + step]].max())) for i in range(0, len(rows), step))
    return chunks


def executed_tiles(mask: TreeMask) -> int:
    """B×B tiles the block path computes per attention call, its padding included (flex computes the listed blocks)."""
    return sum(len(rows) * K for rows, K in _plan_chunks(mask))


def _block_plan(mask: TreeMask) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per SDPA call (``_plan_chunks``): (query block ids [G], key positions [G, K·B], partial mask [G, B, K·B])."""
    B = mask.BLOCK_SIZE[0]
    se = mask.subtree_end
    n, dev = int(se.shape[0]), se.device
    nb = -(-n // B)
    if nb == 0:
        return []
    # Every row's kv blocks, partial and full, merged ascending (the order does not change the result).
    kv = torch.cat([mask.kv_indices[0, 0], mask.full_kv_indices[0, 0]], dim=1).cpu()
    width = torch.arange(kv.shape[1])
    valid = torch.cat([width[None, : mask.kv_indices.shape[-1]] < mask.kv_num_blocks[0, 0].cpu()[:, None],
                       width[None, : mask.full_kv_indices.shape[-1]] < mask.full_kv_num_blocks[0, 0].cpu()[:, None]], dim=1)
    se_pad = torch.cat([se, torch.zeros(nb * B - n, dtype=se.dtype, device=dev)])
    plan = []
    r = torch.arange(B)
    for rows, K in _plan_chunks(mask):
        # The valid kv blocks of each row first, padded with its diagonal block (always listed; masked out below).
        order = torch.argsort((~valid[rows]).to(torch.int8), dim=1, stable=True)[:, :K]
        blocks = torch.gather(kv[rows], 1, order)
        ok = torch.gather(valid[rows], 1, order)
        blocks = torch.where(ok, blocks, rows[:, None])
        keys = (blocks[:, :, None] * B + r).reshape(len(rows), K * B)
        key_ok = ok[:, :, None].expand(-1, -1, B).reshape(len(rows), K * B)
        q = rows[:, None] * B + r  # [G, B]
        keys_d, q_d = keys.to(dev), q.to(dev)
        visible = (keys_d[:, None, :] <= q_d[:, :, None]) & (q_d[:, :, None] < se_pad[keys_d][:, None, :])
        # Padded queries (past N, last block only) see their own padded key: no row is empty (SDPA would give NaN).
        visible |= (q_d[:, :, None] >= n) & (keys_d[:, None, :] == q_d[:, :, None])
        visible &= key_ok.to(dev)[:, None, :]
        plan.append((rows.to(dev), keys_d, visible))
    return plan


def _block_attention(mask: TreeMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], gqa: bool) -> torch.Tensor:
    plan = mask._cache.get(("block", q.device))
    if plan is None:
        plan = mask._cache[("block", q.device)] = _block_plan(mask)
    B = mask.BLOCK_SIZE[0]
    _, H, n, D = q.shape
    nb = -(-n // B)
    pad = nb * B - n
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    qb = qp[0].reshape(H, nb, B, D)
    # Keys and values position-major, gathered with index_select: its backward is index_add, where advanced indexing's
    # is a sorting index_put.
    kt, vt = kp[0].transpose(0, 1), vp[0].transpose(0, 1)  # [N', Hkv, D]
    outs, order = [], []
    for rows, keys, visible in plan:
        G = rows.shape[0]
        qg = qb.index_select(1, rows).transpose(0, 1)  # [G, H, B, D]
        kg = kt.index_select(0, keys.flatten()).reshape(G, -1, kt.shape[1], D).transpose(1, 2)
        vg = vt.index_select(0, keys.flatten()).reshape(G, -1, vt.shape[1], vt.shape[-1]).transpose(1, 2)
        outs.append(F.scaled_dot_product_attention(qg, kg, vg, attn_mask=visible[:, None], scale=scale, enable_gqa=gqa))
        order.append(rows)
    out = torch.cat(outs)[torch.argsort(torch.cat(order))]  # [nb, H, B, Dv] in block order
    return out.permute(1, 0, 2, 3).reshape(1, H, nb * B, -1)[:, :, :n]


_compiled_flex: Any = None


def attend(mask: TreeMask, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Tree attention of q [1, H, N, D], k/v [1, Hkv, N, D] (Hkv dividing H): [1, H, N, Dv], by ``mask.mode``."""
    if not isinstance(mask, TreeMask):
        raise TreepackError("E_ARG", f"expected a TreeMask from treepack.torch.tree_mask(batch), got {type(mask).__name__}", field="attention_mask")
    n = int(mask.subtree_end.shape[0])
    if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != n or key.shape[2] != n:
        raise TreepackError("E_ARG", f"expected q, k, v of shape [1, H, N = {n}, D] (one packed row, no KV cache), got q {list(query.shape)}, k {list(key.shape)}", field="attention_mask")
    if query.device != mask.subtree_end.device:
        raise TreepackError("E_ARG", f"the mask is on {mask.subtree_end.device}, the attention inputs on {query.device}", field="attention_mask")
    gqa = key.shape[1] != query.shape[1]
    if mask.mode == "dense":
        dense = mask._cache.get("dense")
        if dense is None:
            dense = mask._cache["dense"] = dense_tree_mask(mask.subtree_end)[None, None]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=dense, scale=scale, enable_gqa=gqa)
    if mask.mode == "block":
        return _block_attention(mask, query, key, value, scale, gqa)
    global _compiled_flex
    fn = flex_attention
    if query.is_cuda:
        _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    elif torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        raise TreepackError("E_ARG", "FlexAttention has no backward on CPU; use tree_mask(batch, mode='block') to train on CPU", field="mode")
    else:
        # torch refuses requires_grad inputs on CPU even under no_grad, where nothing is recorded anyway.
        query, key, value = query.detach(), key.detach(), value.detach()
    return fn(query, key, value, block_mask=mask, scale=scale, enable_gqa=gqa)


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """The ``"treepack"`` entry of transformers' AttentionInterface: output [1, N, H, Dv] as HF expects."""
    if attention_mask is None:
        raise TreepackError("E_ARG", "attn_implementation 'treepack' needs attention_mask=treepack.torch.tree_mask(batch)", field="attention_mask")
    if dropout:
        raise TreepackError("E_ARG", f"attention dropout {dropout} is not supported by the tree attention (call model.eval() or set it to 0)", field="dropout")
    if kwargs.get("sliding_window") is not None:
        raise TreepackError("E_ARG", "sliding-window layers are not supported by the tree attention", field="sliding_window")
    out = attend(attention_mask, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> bool:
    """Registers ``"treepack"`` with transformers' AttentionInterface (done on import when transformers is
    installed); False when transformers is absent."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register("treepack", tree_attention)
    return True


register()
