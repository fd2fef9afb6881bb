"""Packing sequences that show images (Qwen2-VL family processors), in Python: the forest, the image fills and the
3-D rotary positions of the micro-batch contract (docs/reference/format.md, "Images").

A sequence is a list of token ids and image names; ``images`` maps each name to its decoded pixels (uint8
[H, W, 3]). Each image expands to t·h·w / merge_size² placeholder tokens (``image_token_id``) with the grid the
processor makes of its size (``treepack.microbatch.expected_grid``). Two placeholders are one node only when they
are the same placeholder of the same image (its pixels' SHA-256, whatever the name) after the same prefix, so calls
that resend a screenshot share it and different screenshots never merge.

    >>> import numpy as np, treepack
    >>> shot = np.zeros((16, 16, 3), dtype=np.uint8)            # a 16x16 screenshot: 4 placeholders
    >>> proc = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 64, "max_pixels": 1024,
    ...         "image_token_id": 120}
    >>> mb = pack_images([[1, 2, "s", 3], [1, 2, "s", 4]], {"s": shot}, proc)
    >>> mb.meta["num_tokens_naive"], mb.meta["num_tokens_packed"], mb.image_fills.tolist()
    (14, 8, [[0, 2, 0, 4]])
    >>> mb.mrope_position_ids[:, :7].tolist()                   # text 0, 1; the image's 2x2 grid from 2; text after it
    [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]
    >>> treepack.check_invariants(mb)
    []

Positions follow transformers' ``get_rope_index`` for images (Qwen2.5-VL, Qwen3-VL): a text token takes the next
position on all three axes; an image starting at position s places its placeholder (r, c) at (s, s + r, s + c) on
the merged grid and moves the next position to s + max(rows, columns). Each node's positions depend on its prefix
only, so every occurrence of a node agrees (python/tests/trainer/test_vision.py checks them against the model's own).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np

from .errors import TreepackError
from .microbatch import PROCESSOR_KEYS, MicroBatch, expected_grid
from .pack import pack_sequences

Element = Union[int, str]


def image_hash(pixels: np.ndarray, processor: Mapping[str, Any]) -> str:
    """An image's identity: the SHA-256 of its size, its decoded bytes and the processor settings it is seen with."""
    h = hashlib.sha256(json.dumps([list(pixels.shape), dict(sorted(processor.items()))]).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return "sha256:" + h.hexdigest()


def _check_image(name: str, pixels: Any) -> np.ndarray:
    a = np.asarray(pixels)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or 0 in a.shape:
        raise TreepackError("E_ARG", f"image {name!r} must be uint8 [H, W, 3] pixels, got {a.dtype} {list(a.shape)}", field="images")
    return a


def pack_images(
    sequences: Sequence[Sequence[Element]],
    images: Mapping[str, np.ndarray],
    processor: Mapping[str, Any],
    loss_mask: Sequence[Sequence[int]] | None = None,
    advantages: Sequence[float] | None = None,
    tokenizer: str = "unknown",
    sequence_ids: Sequence[str] | None = None,
) -> MicroBatch:
    """The micro-batch of ``sequences`` (token ids and names of ``images``) with its image tensors and
    ``mrope_position_ids``; ``processor``: the header's image_processor settings (``PROCESSOR_KEYS`` at least).
    ``loss_mask``: per sequence, one 0/1 per element (an image's must be 0); ``advantages``: one number per
    sequence; ``tokenizer`` and ``sequence_ids`` as ``pack_sequences`` takes them."""
    missing = [k for k in PROCESSOR_KEYS if k not in processor]
    if missing:
        raise TreepackError("E_ARG", f"processor settings lack {', '.join(missing)}", field="processor")
    merge, token = int(processor["merge_size"]), int(processor["image_token_id"])
    # Distinct images by content, in order of first use; each one's placeholder keys sit above every token id.
    order: dict[str, int] = {}
    pixels: list[np.ndarray] = []
    grids: list[tuple[int, int, int]] = []
    hashes: list[str] = []
    expanded, keys, masks, mrope = [], [], [], []
    for s, seq in enumerate(sequences):
        ids: list[int] = []
        key: list[int] = []
        mask: list[int] = []
        pos: list[np.ndarray] = []
        cur = 0
        for e, el in enumerate(seq):
            m = 1 if loss_mask is None else int(loss_mask[s][e])
            if isinstance(el, str):
                if el not in images:
                    raise TreepackError("E_ARG", f"sequence {s} shows image {el!r}, which images does not hold", field="sequences")
                a = _check_image(el, images[el])
                h = image_hash(a, processor)
                if h not in order:
                    order[h] = len(pixels)
                    pixels.append(a)
                    grids.append(expected_grid(dict(processor), a.shape[0], a.shape[1]))
                    hashes.append(h)
                i = order[h]
                t, gh, gw = grids[i][0], grids[i][1] // merge, grids[i][2] // merge
                n = t * gh * gw
                if m and loss_mask is not None:
                    raise TreepackError(
                        "E_ARG", f"loss_mask[{s}][{e}] is 1 on image {el!r}: placeholders are not trained", field="loss_mask"
                    )
                ids += [token] * n
                key += [-(i << 24 | j) - 1 for j in range(n)]  # negative: apart from every token id
                mask += [0] * n
                tt, rr, cc = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
                pos.append(np.stack([tt.ravel(), rr.ravel(), cc.ravel()]) + cur)
                cur += max(gh, gw)
            else:
                if int(el) == token:
                    raise TreepackError("E_ARG", f"sequence {s} has image_token_id {token} as text at element {e}", field="sequences")
                ids.append(int(el))
                key.append(int(el))
                mask.append(m)
                pos.append(np.full((3, 1), cur))
                cur += 1
        expanded.append(ids)
        keys.append(key)
        masks.append(mask)
        mrope.append(np.concatenate(pos, axis=1) if pos else np.zeros((3, 0), dtype=np.int64))
    if len(pixels) >= 1 << 7:
        raise TreepackError("E_ARG", f"{len(pixels)} distinct images: at most 127 per micro-batch here", field="images")
    # pack_sequences takes ids >= 0: shift every key above the largest (keys of placeholders first).
    flat = [k for key in keys for k in key]
    low = min(flat, default=0)
    mb = pack_sequences(
        [[k - low for k in key] for key in keys],
        tokenizer,
        sequence_ids,
        loss_mask=None if loss_mask is None else masks,
        advantages=advantages,
    )
    node_key = mb.input_ids.astype(np.int64) + low
    placeholder = node_key < 0
    code = -node_key[placeholder] - 1
    node_img = np.full(len(node_key), -1, dtype=np.int64)
    node_ph = np.zeros(len(node_key), dtype=np.int64)
    node_img[placeholder], node_ph[placeholder] = code >> 24, code & ((1 << 24) - 1)
    mb.input_ids = np.where(placeholder, token, node_key).astype(np.int32)
    nodes_mrope = np.zeros((3, len(node_key)), dtype=np.int32)
    nodes_mrope[:, mb.seq_positions] = np.concatenate(mrope, axis=1) if mrope else np.zeros((3, 0))
    mb.mrope_position_ids = nodes_mrope
    if pixels:
        mb.image_pixels = np.concatenate([p.ravel() for p in pixels])
        mb.image_sizes = np.array([p.shape[:2] for p in pixels], dtype=np.int32)
        mb.image_grid_thw = np.array(grids, dtype=np.int32)
        mb.image_fills = fills_of(node_img, node_ph, mb.parent)
        mb.meta["image_processor"] = dict(processor)
        mb.meta["image_hashes"] = hashes
    return mb


def fills_of(node_img: np.ndarray, node_ph: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """int32 [F, 4]: the image fills of a forest whose node p is placeholder ``node_ph[p]`` of image ``node_img[p]``
    (-1: not an image's), one per run of nodes that chain (parent = previous node) through consecutive placeholders
    of one image."""
    p = np.arange(len(node_img))
    shown = node_img >= 0
    prev = np.maximum(p - 1, 0)
    continues = shown & (p > 0) & (parent == p - 1) & (node_img[prev] == node_img) & (node_ph[prev] + 1 == node_ph)
    starts = np.flatnonzero(shown & ~continues)
    run = np.cumsum(shown & ~continues) - 1
    counts = np.bincount(run[shown], minlength=len(starts))
    return np.stack([node_img[starts], starts, node_ph[starts], counts], axis=1).astype(np.int32)
