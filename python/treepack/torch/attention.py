"""Tree attention for any Hugging Face causal LM: the ``"treepack"`` attn_implementation.

    >>> import torch, treepack, treepack.torch as tpt
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> batch = tpt.load_microbatch(treepack.list_microbatches("packed")[0])
    >>> mask = tree_mask(batch)                                  # from subtree_end; no --masks needed
    >>> out = model(batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask)
    >>> out.logits.shape                                         # [1, N, vocab]: a row per node
    torch.Size([1, 10, 64])
    >>> plain = AutoModelForCausalLM.from_pretrained("tiny-model")   # stock attention: sequence b alone
    >>> b = batch.seq_positions[batch.seq_offsets[1]:]              # its nodes
    >>> torch.allclose(out.logits[0, b], plain(batch.input_ids[b][None]).logits[0], atol=1e-5)
    True

Query q attends to key k iff ``k <= q < subtree_end[k]``. ``tree_mask`` builds a ``TreeMask``: a FlexAttention
``BlockMask`` (its block lists built with torch ops on ``subtree_end``'s own device, ``treepack.torch.blocks``: no
host round trip, no device synchronisation) that also carries ``subtree_end`` and how to attend:

- ``"flex"``: compiled ``flex_attention`` on every device (``treepack.torch.compiled_flex``): each call padded to a
  length on a ladder (``ladder_length``), so a run compiles once per rung, never falling back to uncompiled flex;
  on CPU forward only, in float32, bfloat16 or float16 (torch compiles no CPU backward);
- ``"dense"``: SDPA with the dense bool [N, N] mask, built once per mask (O(N²) memory: small batches);
- ``"block"``: block-sparse SDPA on any device, with backward: query blocks are grouped by how many kv blocks they
  see, and each group runs SDPA over its gathered kv blocks with their partial masks, in calls of at most
  ``PLAN_TILES`` tiles, so the work and memory are O(visible blocks · B²), not N² (``executed_tiles`` counts them);
- ``"auto"`` (default): flex on CUDA, block elsewhere.

A HF model passes a 4-D BlockMask straight to its attention function, so the TreeMask reaches ``tree_attention``
unchanged; any mask other than a TreeMask is refused there (TreepackError), never silently run causal. Models that
build one mask per layer type (gpt-oss, Gemma 3/4, Qwen3 with sliding layers) hand the same TreeMask to every layer;
each layer's attention call says its own window (``sliding_window=``, checked against ``config.layer_types`` and
``config.sliding_window``) and sinks (``s_aux=``, gpt-oss), and ``attend`` applies them in every mode:

- the window (docs/design.md §8: ``position_ids[q] - position_ids[k] < window``, Hugging Face's convention) from the
  mask's ``position_ids``, through a windowed TreeMask derived once per window and cached on the mask, whose block
  lists drop the tiles wholly outside the window (the work is O(N · window) on a chain);
- sinks, a per-head logit in every row's softmax denominator, as one more key every query sees, with value 0 and
  score exactly the sink: flex appends a key block whose first key a ``score_mod`` scores ``sinks[h]``; SDPA takes
  no score function, so the dense and block paths append one key per kv head and widen the head dim instead: q gains
  G = H / Hkv coordinates (one-hot of its head within its group), real keys zeros there and the sink key
  ``sinks / scale`` there.

With ``rows`` (a step plan's cached prefix), only query rows [rows, N) are computed, in every mode.

``dense_model_mask`` gives ``sdpa`` / ``eager`` models (``packed_logprobs``' dense path) each layer's dense mask, or
refuses.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from ..flex import check_window, tree_mask_mod
from ..microbatch import TreepackError
from ..versions import require
from .blocks import Arrays, block_arrays, check_host_tree
from .compiled_flex import flex_attend, flex_tiles

MODES = ("auto", "flex", "dense", "block")


class NotTreeAware(TreepackError, AttributeError):
    """A TreeMask reached code that is not tree-aware; an AttributeError too, so ``hasattr`` probes stay False."""


class TreeMask(BlockMask):
    """A BlockMask of the tree rule that also knows ``subtree_end``, ``position_ids`` (None when built from a bare
    ``subtree_end``), its ``window`` (None: the plain tree rule) and its attention ``mode``; the block-sparse and dense
    paths cache their gather plans and masks on it, and the plain mask its windowed variants, so every layer of a
    forward shares them."""

    subtree_end: torch.Tensor
    position_ids: torch.Tensor | None
    window: int | None
    mode: str
    _cache: dict[Any, Any]
    # Always built with its full blocks (_make_mask): never None here, unlike a bare BlockMask's.
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    # A step plan's cached prefix (stepplan._Prefix), set by its executor on the mask it builds; absent otherwise.
    prefix: Any

    @property
    def ndim(self) -> int:
        """Refuses: a model with recurrent layers reads it only when treepack.torch.prepare has not made it tree-aware."""
        # transformers reads a mask's ndim to build its recurrent layers' padding mask: a TreeMask gets there only in
        # a hybrid model that treepack.torch.prepare has not made tree-aware (its hook hands the layers the TreeMask).
        raise NotTreeAware(
            "E_ARG",
            "this model has recurrent layers: call treepack.torch.prepare(model) before passing it a TreeMask (packed_logprobs does)",
            field="attention_mask",
        )


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
    device: str | torch.device | None = None,
    position_ids: Any = None,
) -> TreeMask:
    """The TreeMask of a ``PackedBatch`` (or a ``subtree_end`` tensor / array) on ``device`` (the tensor's by
    default). ``block_size`` is the BlockMask's tile (FlexAttention wants a multiple of 128 on GPU; the block-sparse
    path runs any size). ``position_ids`` (a batch's own by default) are what sliding-window layers measure their
    window in; a mask without them refuses those layers. The block lists are built on ``device`` with torch ops
    (``treepack.torch.blocks``); a ``subtree_end`` on the host is checked first (TreepackError naming it), one already
    on a device is not read back (its loader checked it)."""
    if mode not in MODES:
        raise TreepackError("E_ARG", f"expected one of {', '.join(MODES)}, got {mode!r}", field="mode")
    se = _subtree_end_of(batch_or_subtree_end)
    pos = getattr(batch_or_subtree_end, "position_ids", None) if position_ids is None else position_ids
    if pos is not None:
        pos = torch.as_tensor(pos)
        if pos.shape != se.shape or pos.dtype.is_floating_point or pos.dtype == torch.bool:
            raise TreepackError(
                "E_ARG",
                f"expected a 1-D integer tensor of N = {se.shape[0]} elements, got {pos.dtype} {list(pos.shape)}",
                field="position_ids",
            )
    dev = torch.device(device) if device is not None else se.device
    if se.device.type == "cpu" and dev.type != "cpu":  # checked before the upload: block_arrays checks host trees only
        check_host_tree(se)
    se = se.detach().to(dev, torch.int64)
    mode = ("flex" if dev.type == "cuda" else "block") if mode == "auto" else mode
    arrays = block_arrays(se, block_size)
    return _make_mask(int(block_size), arrays, se, None if pos is None else pos.to(dev, torch.int64), None, mode)


def _make_mask(block_size: int, arrays: Arrays, se: torch.Tensor, pos: torch.Tensor | None, window: int | None, mode: str) -> TreeMask:
    n = int(se.shape[0])
    kv_num, kv_idx, full_num, full_idx = (a[None, None] for a in arrays)
    mask = TreeMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(se, pos, window),
        seq_lengths=(n, n),
    )
    mask.subtree_end, mask.position_ids, mask.window, mask.mode, mask._cache = se, pos, window, mode, {}
    return mask


def windowed(mask: TreeMask, window: int | None) -> TreeMask:
    """The TreeMask of the tree rule with a sliding window, derived from a plain one once per window (cached on it);
    ``mask`` itself for ``window=None``."""
    if window is None:
        return mask
    window = check_window(window)
    if mask.window is not None:
        raise TreepackError(
            "E_ARG", f"this mask already has a window of {mask.window}; pass the plain tree_mask(batch)", field="sliding_window"
        )
    got = mask._cache.get(("window", window))
    if got is None:
        if mask.position_ids is None:
            raise TreepackError(
                "E_ARG",
                f"a sliding-window layer (window {window}) needs position_ids: build the mask with tree_mask(batch) "
                "or tree_mask(subtree_end, position_ids=...)",
                field="position_ids",
            )
        B = mask.BLOCK_SIZE[0]
        arrays = block_arrays(mask.subtree_end, B, mask.position_ids, window)
        got = mask._cache[("window", window)] = _make_mask(B, arrays, mask.subtree_end, mask.position_ids, window, mask.mode)
    return got


def dense_tree_mask(subtree_end: torch.Tensor, position_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """bool [N, N], row = query (O(N²)): the reference and the ``"dense"`` mode's mask; with ``window`` (and
    ``position_ids``) also ``position_ids[q] - position_ids[k] < window``."""
    n = subtree_end.shape[0]
    ar = torch.arange(n, device=subtree_end.device)
    mask = (ar[None, :] <= ar[:, None]) & (ar[:, None] < subtree_end[None, :])
    if window is not None:
        if position_ids is None:
            raise TreepackError("E_ARG", "a windowed mask needs position_ids", field="position_ids")
        pos = position_ids.to(subtree_end.device)
        mask &= pos[:, None] - pos[None, :] < check_window(window)
    return mask


# Most B×B tiles one SDPA call of the block path computes. Each call gathers its rows' kv blocks and a G × B × K·B mask
# (SDPA makes it float): at 256 tiles of 128² that is ~16 MB, where one call per group reached hundreds of MB in a
# 15k-token micro-batch and ran ~1.5× slower per tile than small ones (measured on CPU; the cost was then not linear
# in the tiles, as the bench's cost model assumes).
PLAN_TILES = 256


def _plan_chunks(mask: TreeMask, first: int = 0) -> list[tuple[torch.Tensor, int]]:
    """The block path's SDPA calls for query blocks [first, nb): (query block ids [G], K) per call, where K is the
    most kv blocks a row of the call sees. Rows are grouped by that count rounded up to a power of two (at most 2×
    padding), and a group is split so that G·K ≤ PLAN_TILES (a row alone may exceed it)."""
    num = (mask.kv_num_blocks[0, 0] + mask.full_kv_num_blocks[0, 0]).cpu()
    if num.numel() <= first:
        return []
    bucket = torch.ceil(torch.log2(num[first:].clamp(min=1).double())).long()
    chunks: list[tuple[torch.Tensor, int]] = []
    for b in torch.unique(bucket).tolist():
        rows = torch.nonzero(bucket == b).flatten() + first
        K = int(num[rows].max())
        step = max(1, PLAN_TILES // K)
        chunks.extend((rows[i : i + step], int(num[rows[i : i + step]].max())) for i in range(0, len(rows), step))
    return chunks


def executed_tiles(mask: TreeMask) -> int:
    """B×B tiles one attention call computes: for the block path its SDPA calls' tiles, their padding included; for
    flex the tiles listed by the BlockMask it runs, which is padded to its ladder rung (``ladder_length``: a tile per
    padded query block)."""
    if mask.mode == "flex":
        return flex_tiles(mask)
    return sum(len(rows) * K for rows, K in _plan_chunks(mask))


def _block_plan(mask: TreeMask, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per SDPA call (``_plan_chunks``) of query blocks [first, nb): (query block ids [G], key positions [G, K·B],
    partial mask [G, B, K·B]). The blocks before ``first`` (a cached prefix's or a context-parallel rank's context
    rows, read by nobody) get no plan: their masks would cost O(rows²) memory on a long prefix."""
    B = mask.BLOCK_SIZE[0]
    se = mask.subtree_end
    n, dev = int(se.shape[0]), se.device
    nb = -(-n // B)
    if nb == 0:
        return []
    # Every row's kv blocks, partial and full, merged ascending (the order does not change the result).
    kv = torch.cat([mask.kv_indices[0, 0], mask.full_kv_indices[0, 0]], dim=1).cpu()
    width = torch.arange(kv.shape[1])
    valid = torch.cat(
        [
            width[None, : mask.kv_indices.shape[-1]] < mask.kv_num_blocks[0, 0].cpu()[:, None],
            width[None, : mask.full_kv_indices.shape[-1]] < mask.full_kv_num_blocks[0, 0].cpu()[:, None],
        ],
        dim=1,
    )
    se_pad = torch.cat([se, torch.zeros(nb * B - n, dtype=se.dtype, device=dev)])
    window, pos = mask.window, mask.position_ids
    if window is not None and pos is None:
        raise TreepackError("E_ARG", f"a sliding-window mask (window {window}) needs position_ids", field="position_ids")
    pos_pad = None if window is None or pos is None else torch.cat([pos, pos.new_zeros(nb * B - n)])
    plan = []
    r = torch.arange(B)
    for rows, K in _plan_chunks(mask, first):
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
        if pos_pad is not None and window is not None:
            visible &= pos_pad[q_d][:, :, None] - pos_pad[keys_d][:, None, :] < window
        # Padded queries (past N, last block only) see their own padded key: no row is empty (SDPA would give NaN).
        visible |= (q_d[:, :, None] >= n) & (keys_d[:, None, :] == q_d[:, :, None])
        visible &= key_ok.to(dev)[:, None, :]
        plan.append((rows.to(dev), keys_d, visible))
    return plan


def _with_sink_key(q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, H, Nq, D+G] and k [1, Hkv, N, D+G] widened so that one more key per kv head, the returned sink key
    [Hkv, D+G], scores exactly ``sinks[h]`` against every query of head h (G = H / Hkv; enable_gqa maps query head h
    to kv head h // G), while every real score is unchanged (the new coordinates add q·0)."""
    _, H, nq, D = q.shape
    _, Hkv, n, _ = k.shape
    G = H // Hkv
    onehot = torch.eye(G, dtype=q.dtype, device=q.device).repeat(Hkv, 1)  # [H, G]: head h's place in its group
    q2 = torch.cat([q, onehot[None, :, None, :].expand(1, H, nq, G)], dim=-1)
    k2 = torch.cat([k, k.new_zeros(1, Hkv, n, G)], dim=-1)
    sink_key = torch.cat([k.new_zeros(Hkv, D), (sinks.to(k.dtype) / scale).reshape(Hkv, G)], dim=-1)
    return q2, k2, sink_key


def _block_attention(
    mask: TreeMask,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    gqa: bool,
    sinks: torch.Tensor | None,
    skip: int = 0,
) -> torch.Tensor:
    B = mask.BLOCK_SIZE[0]
    first = skip // B  # query blocks before it hold only rows nobody reads
    plan = mask._cache.get(("block", q.device, first))
    if plan is None:
        plan = mask._cache[("block", q.device, first)] = _block_plan(mask, first)
    _, H, n, D = q.shape
    nb = -(-n // B)
    pad = nb * B - n
    sink_key = None
    if sinks is not None:
        scale = D**-0.5 if scale is None else scale
        q, k, sink_key = _with_sink_key(q, k, sinks, scale)
        D = q.shape[-1]
        sink_plan = mask._cache.get(("block-sink", q.device, first))
        if sink_plan is None:
            # Every call also gathers the sink row, stored after the padded keys, and every query sees it.
            sink_plan = mask._cache[("block-sink", q.device, first)] = [
                (
                    rows,
                    torch.cat([keys, keys.new_full((keys.shape[0], 1), nb * B)], dim=1),
                    torch.cat([visible, visible.new_ones(visible.shape[:2] + (1,))], dim=2),
                )
                for rows, keys, visible in plan
            ]
        plan = sink_plan
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    qb = qp[0].reshape(H, nb, B, D)
    # Keys and values position-major, gathered with index_select: its backward is index_add, where advanced indexing's
    # is a sorting index_put.
    kt, vt = kp[0].transpose(0, 1), vp[0].transpose(0, 1)  # [N', Hkv, D]
    if sink_key is not None:
        kt = torch.cat([kt, sink_key[None]])
        vt = torch.cat([vt, vt.new_zeros(1, *vt.shape[1:])])
    outs, order = [], []
    for rows, keys, visible in plan:
        G = rows.shape[0]
        qg = qb.index_select(1, rows).transpose(0, 1)  # [G, H, B, D]
        kg = kt.index_select(0, keys.flatten()).reshape(G, -1, kt.shape[1], D).transpose(1, 2)
        vg = vt.index_select(0, keys.flatten()).reshape(G, -1, vt.shape[1], vt.shape[-1]).transpose(1, 2)
        outs.append(F.scaled_dot_product_attention(qg, kg, vg, attn_mask=visible[:, None], scale=scale, enable_gqa=gqa))
        order.append(rows)
    out = torch.cat(outs)[torch.argsort(torch.cat(order))]  # [nb - first, H, B, Dv] in block order
    return out.permute(1, 0, 2, 3).reshape(1, H, (nb - first) * B, -1)[:, :, skip - first * B : n - first * B]


def _dense_attention(
    mask: TreeMask,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    gqa: bool,
    sinks: torch.Tensor | None,
    rows: int = 0,
) -> torch.Tensor:
    dense = mask._cache.get("dense")
    if dense is None:
        dense = mask._cache["dense"] = dense_tree_mask(mask.subtree_end, mask.position_ids, mask.window)
    q, dense = q[:, :, rows:], dense[rows:]
    if sinks is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q, k, sink_key = _with_sink_key(q, k, sinks, scale)
        k = torch.cat([k, sink_key[None, :, None]], dim=2)
        v = torch.cat([v, v.new_zeros(1, v.shape[1], 1, v.shape[-1])], dim=2)
        dense = torch.cat([dense, dense.new_ones(dense.shape[0], 1)], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None], scale=scale, enable_gqa=gqa)


def attend(
    mask: TreeMask,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    rows: int = 0,
) -> torch.Tensor:
    """Tree attention of q [1, H, N, D], k/v [1, Hkv, N, D] (Hkv dividing H): [1, H, N, Dv], by ``mask.mode``; with
    ``window``, only keys within the sliding window (``position_ids[q] - position_ids[k] < window``); with ``sinks``
    [H], each head's sink logit in every row's softmax denominator (gpt-oss). With ``rows``, only query rows
    [rows, N) are computed and returned (a step plan's cached prefix: its rows are read by nobody)."""
    if not isinstance(mask, TreeMask):
        raise TreepackError(
            "E_ARG", f"expected a TreeMask from treepack.torch.tree_mask(batch), got {type(mask).__name__}", field="attention_mask"
        )
    n = int(mask.subtree_end.shape[0])
    if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != n or key.shape[2] != n:
        raise TreepackError(
            "E_ARG",
            f"expected q, k, v of shape [1, H, N = {n}, D] (one packed row, no KV cache), got q {list(query.shape)}, k {list(key.shape)}",
            field="attention_mask",
        )
    if query.device != mask.subtree_end.device:
        raise TreepackError(
            "E_ARG", f"the mask is on {mask.subtree_end.device}, the attention inputs on {query.device}", field="attention_mask"
        )
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],)):
        raise TreepackError(
            "E_ARG",
            f"expected one sink logit per query head, [{query.shape[1]}], got {getattr(sinks, 'shape', type(sinks).__name__)}",
            field="s_aux",
        )
    mask = windowed(mask, window)
    gqa = key.shape[1] != query.shape[1]
    if mask.mode == "dense":
        return _dense_attention(mask, query, key, value, scale, gqa, sinks, rows)
    if mask.mode == "block":
        return _block_attention(mask, query, key, value, scale, gqa, sinks, skip=rows)
    return flex_attend(mask, query, key, value, scale, gqa, sinks, rows)


# config.layer_types entries (transformers' ALLOWED_LAYER_TYPES) by what the tree attention does with them: full
# attention (a "hybrid" layer runs full attention beside a recurrence), sliding-window attention, and types whose
# layers call no attention (recurrent, convolution and MLP-only layers: checked by the layers that handle them).
# Every other type (chunked, indexed, compressed attention...) is refused where it would reach the tree attention.
FULL_LAYER_TYPES = ("full_attention", "hybrid")
SLIDING_LAYER_TYPES = ("sliding_attention", "hybrid_sliding")
NON_ATTENTION_LAYER_TYPES = ("linear_attention", "conv", "moe", "sparse", "dense")


def _layer_name(model: torch.nn.Module | None, module: torch.nn.Module | None, index: int | None) -> str:
    """'layer i (Class)' for errors: the attention module's class where it can be found."""
    if module is None and model is not None:
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and index is not None and index < len(layers):
            module = getattr(layers[index], "self_attn", layers[index])
    return f"layer {index} ({type(module if module is not None else model).__name__})"


def _check_causal(config: Any, name: str) -> None:
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        raise TreepackError(
            "E_ARG",
            f"{name}: bidirectional attention (config.use_bidirectional_attention / is_causal) cannot run on a tree; "
            "the tree rule is causal",
            field="use_bidirectional_attention",
        )


def _config_window(config: Any, index: int, name: str, attention: bool = True) -> int | None:
    """The window ``config.layer_types[index]`` gives the layer: None for full attention (and, unless ``attention``,
    for a layer type that calls no attention), ``config.sliding_window`` for sliding attention; any other type is
    refused."""
    kind = config.layer_types[index]
    if kind in FULL_LAYER_TYPES or (not attention and kind in NON_ATTENTION_LAYER_TYPES):
        return None
    if kind not in SLIDING_LAYER_TYPES:
        raise TreepackError(
            "E_ARG",
            f"{name} has layer type {kind!r}; the tree attention runs {', '.join(FULL_LAYER_TYPES + SLIDING_LAYER_TYPES)} layers",
            field="layer_types",
        )
    window = getattr(config, "sliding_window", None)
    if window is None:
        raise TreepackError("E_ARG", f"{name} is a sliding_attention layer but config.sliding_window is not set", field="sliding_window")
    return check_window(window)


def module_window(module: torch.nn.Module) -> int | None:
    """The sliding window the model config gives an attention module's layer (None: full attention), which
    ``tree_attention`` holds every call to: ``config.layer_types[layer_idx]``, or without per-layer types
    ``config.sliding_window`` for every layer (Mistral, Qwen3-MoE; a layer that does not pass it is refused rather than
    run unwindowed). Context-parallel exchanges read it to fetch only the keys a window layer can see."""
    config = getattr(module, "config", None)
    index = getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is not None and isinstance(index, int) and 0 <= index < len(types):
        return _config_window(config, index, _layer_name(None, module, index))
    window = getattr(config, "sliding_window", None)
    return None if window is None else check_window(window)


def _layer_window(module: torch.nn.Module, window: Any) -> int | None:
    """The window an attention call asked for (``sliding_window=``), checked against the model config, so a sliding
    layer that did not say its window never runs unwindowed (and a full one never windowed)."""
    config = getattr(module, "config", None)
    index = getattr(module, "layer_idx", None)
    name = _layer_name(None, module, index)
    _check_causal(config, name)
    if getattr(module, "is_causal", True) is False:
        raise TreepackError("E_ARG", f"{name} is not causal (is_causal = False); the tree rule is causal", field="is_causal")
    if window is not None:
        try:
            window = check_window(window)
        except TreepackError as e:
            raise TreepackError("E_ARG", f"{name}: {e.reason}", field="sliding_window") from None
    want = module_window(module)
    types = getattr(config, "layer_types", None)
    if types is not None and isinstance(index, int) and 0 <= index < len(types):
        source = f"config.layer_types[{index}] = {types[index]!r}" + (f", config.sliding_window = {want}" if want is not None else "")
    else:
        source = f"config.sliding_window = {getattr(config, 'sliding_window', None)}"
    if window != want:
        raise TreepackError("E_ARG", f"{name} asked for sliding_window = {window}, but {source}", field="sliding_window")
    return None if window is None else int(window)


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"treepack"`` entry of transformers' AttentionInterface: output [1, N, H, Dv] as HF expects. A layer's
    ``sliding_window=`` and ``s_aux=`` (sinks) are applied; attention-logit softcapping is refused, and so is a
    transformers release outside ``treepack.versions.SUPPORTED`` (its calling convention is those releases')."""
    require("transformers")
    if attention_mask is None:
        raise TreepackError(
            "E_ARG", "attn_implementation 'treepack' needs attention_mask=treepack.torch.tree_mask(batch)", field="attention_mask"
        )
    if dropout:
        raise TreepackError(
            "E_ARG",
            f"attention dropout {dropout} is not supported by the tree attention (call model.eval() or set it to 0)",
            field="dropout",
        )
    window = _layer_window(module, kwargs.get("sliding_window"))
    if kwargs.get("softcap") is not None:
        raise TreepackError(
            "E_ARG",
            f"{_layer_name(None, module, getattr(module, 'layer_idx', None))}: attention-logit softcapping "
            f"({kwargs['softcap']}) is not supported by the tree attention",
            field="softcap",
        )
    # A step plan's micro-batch (stepplan.py): its mask covers the whole forest, the cached prefix's keys come first.
    prefix = getattr(attention_mask, "prefix", None)
    if prefix is not None:
        query, key, value = prefix.extend(module, query, key, value)
    try:
        out = attend(
            attention_mask, query, key, value, scaling, window=window, sinks=kwargs.get("s_aux"), rows=0 if prefix is None else prefix.rows
        )
    except TreepackError as e:
        if e.field not in ("s_aux", "position_ids"):
            raise
        raise TreepackError(e.code, f"{_layer_name(None, module, getattr(module, 'layer_idx', None))}: {e.reason}", field=e.field) from None
    return out.transpose(1, 2).contiguous(), None


def _takes_mask_mapping(base: torch.nn.Module) -> bool:
    """Whether the base model's forward takes ``attention_mask`` as a {layer type: mask} mapping (transformers'
    ``isinstance(causal_mask_mapping := attention_mask, dict)``); False when its source cannot be read."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return re.search(r"isinstance\(\s*causal_mask_mapping\s*:=\s*attention_mask\s*,\s*dict\s*\)", source) is not None


def input_embeddings(model: torch.nn.Module) -> Any:
    """A Hugging Face model's input embedding, ``get_input_embeddings()`` (looked up by name: torch types a Module's
    unknown attributes as Tensor | Module)."""
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        raise TreepackError("E_ARG", f"{type(model).__name__} is not a Hugging Face model (no get_input_embeddings)", field="model")
    return get()


def layer_windows(model: torch.nn.Module) -> list[int | None]:
    """Each layer's sliding window as the model config gives it: ``config.sliding_window`` for a sliding layer
    (``config.layer_types``; without them, for every layer when the config sets one), None for full attention and
    for layer types that call no attention. A type the tree attention cannot run, or a bidirectional config, is a
    TreepackError naming the layer (a preparation-time check; ``tree_attention`` checks each call again).

        >>> from transformers import Qwen3Config, Qwen3ForCausalLM
        >>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16, use_sliding_window=True,
        ...                      layer_types=["sliding_attention", "full_attention"])   # as gpt-oss alternates them
        >>> layer_windows(Qwen3ForCausalLM(config))
        [16, None]
    """
    config = model.config
    _check_causal(config, type(model).__name__)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [_config_window(config, i, _layer_name(model, None, i), attention=False) for i in range(len(types))]
    window = getattr(config, "sliding_window", None)
    return [None if window is None else check_window(window)] * int(getattr(config, "num_hidden_layers", 0) or 0)


def dense_model_mask(model: torch.nn.Module, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
    """What an ``sdpa`` / ``eager`` model takes as ``attention_mask`` for a packed batch: the dense 4-D tree mask
    (bool for sdpa, additive float for eager, which adds its mask to the scores), windowed for sliding layers.

    Models whose layers all share one rule get one mask; a model with full and sliding layers gets a {layer type:
    mask} mapping when its forward takes one (gpt-oss, Gemma 3), else a TreepackError naming the layer. A window the
    batch's positions cannot reach changes nothing, so such models take the plain mask. A transformers release
    outside ``treepack.versions.SUPPORTED`` is refused (how a custom mask reaches the layers is those releases')."""
    require("transformers")
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    types = getattr(config, "layer_types", None)
    windows = layer_windows(model)
    pos = batch.position_ids
    span = int(pos.max() - pos.min()) if pos.numel() else 0
    dtype = input_embeddings(model).weight.dtype

    def build(window: int | None) -> torch.Tensor:
        m = dense_tree_mask(batch.subtree_end, pos, window)
        if impl == "eager":
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
        return m[None, None]

    binding = [i for i, w in enumerate(windows) if w is not None and w <= span]
    if not binding:
        return build(None)
    if types is None:
        return build(windows[0])
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    if not _takes_mask_mapping(base):
        raise TreepackError(
            "E_ARG",
            f"{_layer_name(model, None, binding[0])} is a sliding-window layer, and {type(base).__name__} takes no "
            "per-layer-type mask mapping: the dense path would apply one mask to every layer; use attn_implementation='treepack'",
            field="attn_implementation",
        )
    return {"full_attention": build(None), "sliding_attention": build(windows[binding[0]])}


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
