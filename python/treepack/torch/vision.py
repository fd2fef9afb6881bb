"""Vision-language models on packed trees: the vision encoder once per distinct image of a micro-batch, its
embeddings scattered into the node stream at the image fills, the language model run on the tree with the 3-D
rotary positions (``mrope_position_ids``) the format carries per node.

``packed_logprobs(model, batch)`` takes this path for a Qwen2.5-VL or Qwen3-VL model (transformers' classes);
examples/multimodal_tree.py trains one on an agent episode that resends its screenshots.

Pixel values are made by transformers' own image processor from each image's decoded bytes: the one passed as
``image_processor`` (the engine's, e.g. ``AutoImageProcessor.from_pretrained(model_dir)``), else one built from the
header's ``image_processor`` settings (``Qwen2VLImageProcessorPil``, which needs Pillow). Each image's grid must be
the stored ``image_grid_thw``: a mismatch (another processor's settings) is a TreepackError naming the image.

A Qwen3-VL model's deepstack features (added to the first layers' hidden states at the image tokens) take the same
fills. The vision tower attends within each image, never across the tree, so it keeps (or, when the model was
loaded with ``attn_implementation="treepack"``, is given) SDPA attention. Any other vision-language model is refused
by name (``FAMILIES``): its encoder and positions are not known to be exact here.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..images import fills_of
from ..microbatch import TreepackError
from .batch import PackedBatch, filled_nodes
from .rows import RowLayout, from_padded

# The config.model_type of the models this module runs (a Qwen3-VL's deepstack features come with its encoder's output).
FAMILIES = ("qwen2_5_vl", "qwen3_vl")

# Header image_processor keys passed to the processor's constructor (the others say what the checks read).
_PROCESSOR_ARGS = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_mean", "image_std")


def vision_family(model: torch.nn.Module) -> str | None:
    """The model's family in ``FAMILIES`` (its ``config.model_type``); None for a model without a vision encoder.
    A vision-language model of another family is refused (TreepackError naming its class)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in FAMILIES:
        return str(kind)
    if getattr(config, "vision_config", None) is not None:
        raise TreepackError(
            "E_ARG",
            f"{type(model).__name__} ({kind}) is a vision-language model treepack does not run on a tree "
            f"(supported: {', '.join(FAMILIES)})",
            field="model",
        )
    return None


def has_images(batch: PackedBatch) -> bool:
    """Whether any node of ``batch`` is an image placeholder."""
    return batch.image_fills is not None and batch.image_fills.shape[0] > 0


def image_keys(batch: PackedBatch | None, start: int, end: int) -> list[tuple[str, int] | None]:
    """Per node of [start, end): (its image's identity, placeholder index) where an image fills it, else None; the
    identity is the header's image hash, or where the header has none the SHA-256 of the image's size and bytes."""
    keys: list[tuple[str, int] | None] = [None] * (end - start)
    if batch is None or not has_images(batch):
        return keys
    assert batch.image_fills is not None
    hashes = batch.meta.get("image_hashes")

    @functools.cache
    def identity(i: int) -> str:
        if isinstance(hashes, list):
            return str(hashes[i])
        pixels = batch.image(i).cpu().numpy()
        return "bytes:" + hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).hexdigest()

    for node, image, placeholder in zip(*(t.tolist() for t in filled_nodes(batch.image_fills))):
        if start <= node < end:
            keys[node - start] = (identity(image), placeholder)
    return keys


def refuse_images(batch: PackedBatch, where: str) -> None:
    """Refuses, on a path that runs no vision encoder (``where``), a batch with image fills or 3-D positions."""
    for name in ("image_fills", "mrope_position_ids"):
        if getattr(batch, name) is not None:
            raise TreepackError("E_ARG", f"{where} does not run vision-language batches ({name}): use packed_logprobs", field=name)


@functools.lru_cache(maxsize=8)
def _processor_from(settings: str) -> Any:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError as e:
        raise TreepackError(
            "E_BACKEND",
            f"building the image processor from the header needs Pillow ({e}); or pass image_processor=",
            field="image_processor",
        ) from e
    given = json.loads(settings)
    return Qwen2VLImageProcessorPil(**{k: given[k] for k in _PROCESSOR_ARGS})


def default_processor(batch: PackedBatch) -> Any:
    """transformers' Qwen2-VL image processor with the header's ``image_processor`` settings (cached per settings),
    which must name every one of ``_PROCESSOR_ARGS``: the processor's own defaults are one family's (its
    normalisation is CLIP's mean and std; Qwen3-VL's is 0.5), so a missing one is refused, not guessed."""
    settings = batch.meta.get("image_processor")
    if not isinstance(settings, dict):
        raise TreepackError("E_INPUT", "the batch has images but no image_processor settings in its header", field="image_processor")
    missing = [k for k in _PROCESSOR_ARGS if k not in settings]
    if missing:
        raise TreepackError(
            "E_INPUT",
            f"the header's image_processor lacks {', '.join(missing)}, which the pixel values depend on: write them into it, "
            "or pass image_processor= (the engine's)",
            field="image_processor",
        )
    return _processor_from(json.dumps(settings, sort_keys=True))


def _image_name(batch: PackedBatch, i: int) -> str:
    hashes = batch.meta.get("image_hashes")
    return f"image {i}" + (f" ({hashes[i]})" if isinstance(hashes, list) and i < len(hashes) else "")


def pixel_values(batch: PackedBatch, processor: Any = None, images: list[int] | None = None) -> torch.Tensor:
    """The vision encoder's input for ``images`` (default: all) of ``batch``, in that order: each image's decoded
    pixels through ``processor`` (default: ``default_processor``), its grid checked against ``image_grid_thw``."""
    assert batch.image_grid_thw is not None
    if batch.pixel_values is not None:  # made by the trainer's processor already
        rows = batch.image_grid_thw.prod(1)
        starts = (torch.cumsum(rows, 0) - rows).tolist()
        chosen = range(batch.num_images) if images is None else images
        return torch.cat([batch.pixel_values[starts[i] : starts[i] + int(rows[i])] for i in chosen])
    processor = default_processor(batch) if processor is None else processor
    parts = []
    for i in range(batch.num_images) if images is None else images:
        image = batch.image(i).cpu().numpy()
        out = processor(images=[image], input_data_format="channels_last", return_tensors="pt")
        made, stored = out["image_grid_thw"][0].tolist(), batch.image_grid_thw[i].tolist()
        if made != stored:
            raise TreepackError(
                "E_INPUT",
                f"{_image_name(batch, i)}: the image processor makes grid {made} of its {image.shape[0]}x{image.shape[1]} pixels, "
                f"but image_grid_thw says {stored} (the engine's processor settings differ from this one's)",
                field="image_grid_thw",
            )
        parts.append(out["pixel_values"])
    return torch.cat(parts).to(batch.device)


class Encoded(NamedTuple):
    """What the vision encoder made of some images: ``embeds`` [their placeholders, D] and, for Qwen3-VL,
    ``deepstack`` (one such tensor per deepstack layer)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def encode_images(model: torch.nn.Module, batch: PackedBatch, images: list[int], processor: Any = None) -> Encoded:
    """Runs the vision encoder once over ``images`` of ``batch`` (one call, all of them)."""
    hf: Any = model  # Hugging Face's VL models keep the encoder and language model under .model
    base = hf.model
    assert batch.image_grid_thw is not None
    pv = pixel_values(batch, processor, images)
    out = base.get_image_features(pv, batch.image_grid_thw[images], return_dict=True)
    embeds = torch.cat(out.pooler_output)
    deepstack = [torch.cat(f) for f in getattr(out, "deepstack_features", None) or []]
    return Encoded(embeds, deepstack)


def _vision_attention(model: torch.nn.Module) -> None:
    # The tower attends within each image (its own block-diagonal split), never through a tree mask.
    hf: Any = model
    visual = hf.model.visual
    if getattr(visual.config, "_attn_implementation", None) == "treepack":
        visual.set_attn_implementation("sdpa")


def _embed(model: torch.nn.Module, batch: PackedBatch, start: int, end: int, processor: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Input embeddings [end - start, D] of nodes [start, end): token embeddings, the images' at their fills (only
    the images filling a node in the range are encoded), and a Qwen3-VL's deepstack arguments for the range."""
    hf: Any = model
    base = hf.model
    embeds = base.get_input_embeddings()(batch.input_ids[start:end])
    if not has_images(batch):
        return embeds, {}
    assert batch.image_fills is not None and batch.image_grid_thw is not None
    if batch.mrope_position_ids is None:
        raise TreepackError("E_INPUT", "the batch has images but no mrope_position_ids (3-D rotary positions)", field="mrope_position_ids")
    nodes, images, placeholders = filled_nodes(batch.image_fills)
    inside = (nodes >= start) & (nodes < end)
    if not bool(inside.any()):
        return embeds, {}
    nodes, images, placeholders = nodes[inside], images[inside], placeholders[inside]
    used = torch.unique(images)
    encoded = encode_images(model, batch, used.tolist(), processor)
    merge = int(hf.config.vision_config.spatial_merge_size)
    counts = batch.image_grid_thw[used].prod(1) // (merge * merge)
    if bool((placeholders >= counts[torch.searchsorted(used, images)]).any()):
        raise TreepackError("E_INPUT", "image_fills reach past their image's placeholders (image_grid_thw)", field="image_fills")
    rows = (torch.cumsum(counts, 0) - counts)[torch.searchsorted(used, images)] + placeholders
    order = torch.argsort(nodes)
    nodes, rows = nodes[order] - start, rows[order]
    embeds = embeds.index_put((nodes,), encoded.embeds[rows].to(embeds.dtype))
    if not encoded.deepstack:
        return embeds, {}
    visual = torch.zeros(end - start, dtype=torch.bool, device=embeds.device)
    visual[nodes] = True
    return embeds, {"visual_pos_masks": visual[None], "deepstack_visual_embeds": [d[rows].to(embeds.dtype) for d in encoded.deepstack]}


def hidden_states(
    model: torch.nn.Module, batch: PackedBatch, mask: Any, processor: Any = None, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """The language model's final hidden states [end - start, D] of nodes [start, end) (default: all) on the tree:
    token embeddings with the images' embeddings at their fills, 3-D rotary positions, ``mask`` (the tree's; a step
    plan's holds nodes [0, start) cached)."""
    if vision_family(model) is None:
        raise TreepackError("E_ARG", f"{type(model).__name__} has no vision encoder, but the batch has images", field="image_fills")
    end = batch.num_nodes if end is None else end
    _vision_attention(model)
    embeds, extra = _embed(model, batch, start, end, processor)
    positions = batch.mrope_position_ids if batch.mrope_position_ids is not None else batch.position_ids.expand(3, -1)
    hf: Any = model
    base = hf.model
    out = base.language_model(
        inputs_embeds=embeds[None], position_ids=positions[:, None, start:end], attention_mask=mask, use_cache=False, **extra
    )
    hidden: torch.Tensor = out.last_hidden_state[0]
    return hidden


def from_padded_images(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    num_images: Sequence[int],
) -> tuple[PackedBatch, RowLayout]:
    """A trainer's padded rows with images (TRL's: the processor's ``pixel_values`` of every row's images, row after
    row, their ``image_grid_thw`` and ``num_images`` per row) as one packed batch and its layout (``from_padded``).
    An image's identity is its encoder input (bytes of its pixel rows) and grid, so rows that show the same image
    after the same prefix share its placeholder nodes; each distinct image is encoded once. The 3-D positions are
    the model's own ``get_rope_index`` of each row, scattered to its nodes."""
    hf: Any = model
    token, merge = int(hf.config.image_token_id), int(hf.config.vision_config.spatial_merge_size)
    grid = image_grid_thw.to(torch.int64)
    patches = grid.prod(1)
    counts = list(num_images)
    if len(counts) != input_ids.shape[0] or sum(counts) != grid.shape[0]:
        raise TreepackError(
            "E_ARG", f"num_images {counts} does not give {grid.shape[0]} images over {input_ids.shape[0]} rows", field="num_images"
        )
    if pixel_values.shape[0] != int(patches.sum()):
        raise TreepackError(
            "E_ARG", f"pixel_values has {pixel_values.shape[0]} rows, image_grid_thw says {int(patches.sum())}", field="pixel_values"
        )
    starts = (torch.cumsum(patches, 0) - patches).tolist()
    distinct: dict[str, int] = {}
    first_of: list[int] = []  # each distinct image's first index among the rows' images
    ident = []
    for i in range(grid.shape[0]):
        rows = pixel_values[starts[i] : starts[i] + int(patches[i])].detach().cpu().contiguous()
        key = hashlib.sha256(grid[i].cpu().numpy().tobytes() + rows.numpy().tobytes()).hexdigest()
        if key not in distinct:
            distinct[key] = len(first_of)
            first_of.append(i)
        ident.append(distinct[key])
    # Placeholder j of distinct image d becomes a key above every token id, so only the same image merges.
    base = max(int(input_ids.max()) + 1, token + 1)
    keyed = input_ids.to(torch.int64).clone()
    attended = attention_mask.bool()
    image = 0
    for b in range(input_ids.shape[0]):
        cols = torch.nonzero(attended[b] & (input_ids[b] == token)).flatten()
        need = [int(patches[i]) // (merge * merge) for i in range(image, image + counts[b])]
        if sum(need) != cols.numel():
            raise TreepackError(
                "E_ARG", f"row {b} has {cols.numel()} image tokens but its {counts[b]} images fill {sum(need)}", field="input_ids"
            )
        at = 0
        for i, n in zip(range(image, image + counts[b]), need):
            keyed[b, cols[at : at + n]] = base + (ident[i] << 20) + torch.arange(n, device=keyed.device)
            at += n
        image += counts[b]
    batch, layout = from_padded(keyed, attention_mask, response_length=response_length)
    node_key = batch.input_ids
    placeholder = node_key >= base
    node_img = torch.where(placeholder, (node_key - base) >> 20, -1)
    node_ph = torch.where(placeholder, (node_key - base) & ((1 << 20) - 1), 0)
    batch.input_ids = torch.where(placeholder, token, node_key)
    fills = fills_of(node_img.cpu().numpy(), node_ph.cpu().numpy(), batch.parent.cpu().numpy())
    batch.image_fills = torch.from_numpy(fills.astype(np.int64)).to(batch.device)
    batch.image_grid_thw = grid[first_of].to(batch.device)
    batch.pixel_values = torch.cat([pixel_values[starts[i] : starts[i] + int(patches[i])] for i in first_of]) if first_of else None
    rope, _ = hf.model.get_rope_index(
        input_ids=input_ids, mm_token_type_ids=(input_ids == token).int(), image_grid_thw=grid, attention_mask=attention_mask
    )
    mrope = torch.zeros((3, batch.num_nodes), dtype=torch.int64, device=batch.device)
    mrope[:, batch.seq_positions] = rope.permute(1, 2, 0)[attended].T.to(batch.device, torch.int64)  # occurrences in row order
    batch.mrope_position_ids = mrope
    return batch, layout
