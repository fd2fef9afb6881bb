"""Packed micro-batches as torch tensors: the loader and a DataLoader-friendly dataset over a packed directory.

    >>> import treepack
    >>> batch = load_microbatch(treepack.list_microbatches("packed")[0])   # device="cuda" on a GPU
    >>> batch.num_nodes, batch.num_sequences, batch.sequence(1).tolist()
    (10, 2, [2, 3, 4, 5, 8, 9, 1])
    >>> for batch in PackedDataset("packed/", rank=1, dp=2):     # what the manifest gives rank 1 of 2
    ...     print(batch.meta["sequence_ids"], batch.num_nodes)
    ['c', 'd'] 8

Index tensors (and ``routes``) are int64 (what torch indexing takes), ``loss_mask`` is bool, the per-occurrence floats
float32, the image bytes uint8; every tensor is a fresh, writable copy. The forest invariants are checked on load
(``check=False`` skips them): a broken forest would otherwise index the wrong node silently (torch wraps negative indices).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from ..microbatch import (
    IMAGE_FIELDS,
    OCCURRENCE_FLOAT_FIELDS,
    MicroBatch,
    Source,
    TreepackError,
    check_entry,
    check_invariants,
    load,
    read_manifest,
)

INDEX_FIELDS = ("input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions")
# The image tensors, int64 on the batch but image_pixels (uint8), and the 3-D rotary positions.
VISION_FIELDS = tuple(IMAGE_FIELDS) + ("mrope_position_ids",)


@dataclass
class PackedBatch:
    """One packed micro-batch on a device (field meanings: docs/reference/format.md).

    Besides the contract's arrays: ``seq_index`` [M] (the sequence of each occurrence) and ``token_index`` [M] (its
    t), so a per-sequence reduction is one ``index_add_``; ``extra`` holds tensors outside the contract (stored mask
    lowerings) as they were stored. ``routes`` (int64 [MoE layers, N, k]): the experts an engine chose per node, which
    ``packed_logprobs``, ``forward_logprobs`` and step plans replay (``treepack.torch.replay_routes``); loaded from
    the file's ``routes`` tensor ([N, layers, k], transposed here; -1 rows: the router's own top-k), or set by the
    caller (e.g. from ``pack_routed``). ``context_parallel``: set on a rank's local part
    of a row split over a context-parallel group (``treepack.torch.split_batch``), None otherwise.

    A micro-batch with images (docs/reference/format.md, "Images") carries ``image_pixels`` (uint8, each distinct
    image's decoded RGB bytes), ``image_sizes`` [I, 2], ``image_grid_thw`` [I, 3], ``image_fills`` [F, 4] (image,
    first node, first placeholder, count) and ``mrope_position_ids`` [3, N]; ``meta["image_processor"]`` holds the
    processor's settings and ``meta["image_hashes"]`` each image's identity. ``packed_logprobs`` runs the vision
    encoder once per image and scatters its embeddings at the fills (``treepack.torch.vision``). ``pixel_values``
    (not in the file format; set by ``treepack.torch.vision.from_padded_images``) holds the encoder inputs a
    trainer's processor already made, image after image, used instead of processing ``image_pixels``.
    """

    input_ids: torch.Tensor  # int64 [N]
    position_ids: torch.Tensor  # int64 [N]
    parent: torch.Tensor  # int64 [N], -1 for a root
    subtree_end: torch.Tensor  # int64 [N]
    seq_offsets: torch.Tensor  # int64 [S+1]
    seq_positions: torch.Tensor  # int64 [M], the unmerge index
    loss_mask: torch.Tensor  # bool [M]
    seq_index: torch.Tensor  # int64 [M]
    token_index: torch.Tensor  # int64 [M]
    meta: dict[str, Any]
    advantages: torch.Tensor | None = None  # float32 [M]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None  # int64 [M], the contract's extension for turn-level aggregation
    routes: torch.Tensor | None = None  # int64 [MoE layers, N, k]: the experts an engine chose per node, replayed by the forward
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # A rank's local part of a row split by context parallelism (treepack.torch.context_parallel.LocalPart), else None.
    context_parallel: Any = None
    image_pixels: torch.Tensor | None = None  # uint8 [B]: the decoded RGB bytes of each distinct image, concatenated
    image_sizes: torch.Tensor | None = None  # int64 [I, 2]: (height, width)
    image_grid_thw: torch.Tensor | None = None  # int64 [I, 3]: the processor's grid in patches
    image_fills: torch.Tensor | None = None  # int64 [F, 4]: nodes [pos, pos + count) are image's placeholders [first, first + count)
    mrope_position_ids: torch.Tensor | None = None  # int64 [3, N]: temporal, height, width rotary positions
    pixel_values: torch.Tensor | None = None  # float [Σ t·h·w, C]: the images' encoder inputs already made (a trainer's rows)

    @property
    def num_images(self) -> int:
        """I, the number of distinct images (0 without images)."""
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    def image(self, i: int) -> torch.Tensor:
        """Image i's decoded pixels, uint8 [H, W, 3] (a view on ``image_pixels``)."""
        if not 0 <= i < self.num_images:
            raise TreepackError("E_ARG", f"image {i} out of range [0, {self.num_images})", field="image")
        assert self.image_sizes is not None and self.image_pixels is not None
        area = self.image_sizes[:, 0] * self.image_sizes[:, 1] * 3
        start, h, w = int(area[:i].sum()), int(self.image_sizes[i, 0]), int(self.image_sizes[i, 1])
        return self.image_pixels[start : start + h * w * 3].view(h, w, 3)

    @property
    def num_nodes(self) -> int:
        """N, the packed length (nodes, padding included)."""
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        """S, the number of sequences."""
        return int(self.seq_offsets.shape[0]) - 1

    @property
    def num_occurrences(self) -> int:
        """M, the number of (sequence, token) occurrences: the naive token count."""
        return int(self.seq_positions.shape[0])

    @property
    def vocab_size(self) -> int | None:
        """One past the largest id of the tokenizer that made the ids (header ``vocab_size``), when the packer knew it."""
        v = self.meta.get("vocab_size")
        return None if v is None else int(v)

    @property
    def num_pad_tokens(self) -> int:
        """The last ``num_pad_tokens`` nodes are padding (roots no occurrence maps to); 0 when not padded."""
        return int(self.meta.get("num_pad_tokens", 0))

    @property
    def device(self) -> torch.device:
        """The device the tensors are on."""
        return self.input_ids.device

    def _map(self, fn: Any) -> PackedBatch:
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = fn(v)
            elif f.name == "extra":
                v = {k: fn(t) for k, t in v.items()}
            values[f.name] = v
        return PackedBatch(**values)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor moved to ``device`` (as ``torch.Tensor.to``)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies, for ``to("cuda", non_blocking=True)``; also what DataLoader(pin_memory=True) calls."""
        return self._map(lambda t: t.pin_memory())

    def sequence(self, i: int) -> torch.Tensor:
        """Tokens of sequence i, gathered through the unmerge index."""
        if not 0 <= i < self.num_sequences:
            raise TreepackError("E_ARG", f"sequence {i} out of range [0, {self.num_sequences})", field="sequence")
        a, b = int(self.seq_offsets[i]), int(self.seq_offsets[i + 1])
        return self.input_ids[self.seq_positions[a:b]]


def naive_batch(batch: PackedBatch) -> PackedBatch:
    """The same occurrences with no sharing: one node per (sequence, token), each sequence its own chain, N = M. A
    trainer's baseline: the packed batch must give the same loss and gradients at lower cost."""
    M = batch.num_occurrences
    occ = torch.arange(M, device=batch.device)
    meta = {k: v for k, v in batch.meta.items() if k != "num_pad_tokens"}
    meta["num_tokens_packed"] = M
    return PackedBatch(
        input_ids=batch.input_ids[batch.seq_positions],
        position_ids=batch.token_index.clone(),
        parent=torch.where(batch.token_index == 0, -1, occ - 1),
        subtree_end=batch.seq_offsets[batch.seq_index + 1],
        seq_offsets=batch.seq_offsets.clone(),
        seq_positions=occ,
        loss_mask=batch.loss_mask.clone(),
        seq_index=batch.seq_index.clone(),
        token_index=batch.token_index.clone(),
        meta=meta,
        routes=None if batch.routes is None else batch.routes[:, batch.seq_positions],
        extra={},
        mrope_position_ids=None if batch.mrope_position_ids is None else batch.mrope_position_ids[:, batch.seq_positions],
        **_naive_images(batch, meta),
        **{f: (None if getattr(batch, f) is None else getattr(batch, f).clone()) for f in OCCURRENCE_FLOAT_FIELDS + ("turn_ids",)},
    )


def filled_nodes(fills: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(node, image, placeholder) of every node ``image_fills`` [F, 4] fills, fill by fill."""
    img, pos, first, count = fills.unbind(1)
    step = torch.arange(int(count.sum()), device=fills.device) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    return (
        torch.repeat_interleave(pos, count) + step,
        torch.repeat_interleave(img, count),
        torch.repeat_interleave(first, count) + step,
    )


def _naive_images(batch: PackedBatch, meta: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    """The image tensors of ``naive_batch``: each sequence its own copy of every image it shows (the vision encoder
    runs once per sequence and image, as unpacked training does), its fills one per run of occurrences that are
    consecutive placeholders of one image."""
    if batch.image_fills is None or batch.image_sizes is None or batch.image_grid_thw is None or batch.image_pixels is None:
        return {}
    dev, n_images, M = batch.device, batch.num_images, batch.num_occurrences
    nodes, images, placeholders = filled_nodes(batch.image_fills)
    node_img = torch.full((batch.num_nodes,), -1, dtype=torch.int64, device=dev)
    node_ph = torch.zeros(batch.num_nodes, dtype=torch.int64, device=dev)
    node_img[nodes], node_ph[nodes] = images, placeholders
    occ_img, occ_ph = node_img[batch.seq_positions], node_ph[batch.seq_positions]
    shown = occ_img >= 0
    key = batch.seq_index * n_images + occ_img.clamp(min=0)
    keys = torch.unique(key[shown])  # the (sequence, image) pairs shown, each the naive batch's own image
    new_img = torch.searchsorted(keys, key)
    old = keys % n_images
    k = torch.arange(M, device=dev)
    prev = (k - 1).clamp(min=0)
    continues = shown & (k > 0) & shown[prev] & (new_img[prev] == new_img) & (occ_ph[prev] + 1 == occ_ph) & (batch.token_index > 0)
    run_start = torch.nonzero(shown & ~continues).flatten()
    run_id = torch.cumsum((shown & ~continues).to(torch.int64), 0) - 1
    run_count = torch.bincount(run_id[shown], minlength=run_start.numel())
    fills = torch.stack([new_img[run_start], run_start, occ_ph[run_start], run_count], 1)
    area = batch.image_sizes[:, 0] * batch.image_sizes[:, 1] * 3
    offsets = torch.cumsum(area, 0) - area
    pixels = [batch.image_pixels[int(offsets[i]) : int(offsets[i] + area[i])] for i in old.tolist()]
    hashes = batch.meta.get("image_hashes")
    if isinstance(hashes, list):
        meta["image_hashes"] = [hashes[i] for i in old.tolist()]
    return {
        "image_pixels": torch.cat(pixels) if pixels else batch.image_pixels[:0].clone(),
        "image_sizes": batch.image_sizes[old],
        "image_grid_thw": batch.image_grid_thw[old],
        "image_fills": fills,
    }


def _tensor(a: np.ndarray, dtype: np.dtype | None, device: str | torch.device | None, pin: bool) -> torch.Tensor:
    # np.array copies: the file's arrays are read-only views on a memory map.
    t = torch.from_numpy(np.array(a, dtype=dtype))
    if pin:
        t = t.pin_memory()
    return t if device is None else t.to(device, non_blocking=pin)


def from_microbatch(
    mb: MicroBatch,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
    check: bool = True,
    file: str | None = None,
) -> PackedBatch:
    """A numpy ``treepack.MicroBatch`` as a ``PackedBatch`` (see ``load_microbatch``)."""
    if check:
        problems = check_invariants(mb)
        pad = int(mb.meta.get("num_pad_tokens", 0))
        N = len(mb.input_ids)
        if pad and not problems:
            tail = np.arange(N - pad, N)
            if (mb.parent[tail] != -1).any() or (mb.subtree_end[tail] != tail + 1).any():
                problems.append(f"the last num_pad_tokens = {pad} nodes are not childless roots")
            elif (np.asarray(mb.seq_positions) >= N - pad).any():
                problems.append(f"an occurrence maps to one of the last num_pad_tokens = {pad} (padding) nodes")
        if problems:
            lead = re.match(r"[a-z_]+", problems[0])  # each problem starts with the field it is about
            first = lead.group(0) if lead else ""
            raise TreepackError(
                "E_INPUT",
                "not a valid packed micro-batch: " + "; ".join(problems),
                file,
                first if first in INDEX_FIELDS + VISION_FIELDS + ("loss_mask", "image_processor") else "forest",
            )
    offsets = np.asarray(mb.seq_offsets, dtype=np.int64)
    lengths, starts = offsets[1:] - offsets[:-1], offsets[:-1]
    seq_index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    token_index = np.arange(len(mb.seq_positions), dtype=np.int64) - np.repeat(starts, lengths)
    i64 = np.dtype(np.int64)
    values: dict[str, Any] = {f: _tensor(getattr(mb, f), i64, device, pin_memory) for f in INDEX_FIELDS}
    values["loss_mask"] = _tensor(mb.loss_mask != 0, None, device, pin_memory)
    values["seq_index"] = _tensor(seq_index, None, device, pin_memory)
    values["token_index"] = _tensor(token_index, None, device, pin_memory)
    for f in OCCURRENCE_FLOAT_FIELDS:
        a = getattr(mb, f)
        values[f] = None if a is None else _tensor(a, np.dtype(np.float32), device, pin_memory)
    values["turn_ids"] = None if mb.turn_ids is None else _tensor(mb.turn_ids, i64, device, pin_memory)
    # The file stores routes node-major [N, layers, k]; replay takes them layer-major, one [N, k] per MoE layer.
    values["routes"] = None if mb.routes is None else _tensor(np.asarray(mb.routes).transpose(1, 0, 2), i64, device, pin_memory)
    for f in VISION_FIELDS:
        a = getattr(mb, f)
        values[f] = None if a is None else _tensor(a, None if f == "image_pixels" else i64, device, pin_memory)
    extra = {k: _tensor(a, None, device, pin_memory) for k, a in mb.extra.items()}
    return PackedBatch(meta=dict(mb.meta), extra=extra, **values)


def load_microbatch(
    src: Source | MicroBatch,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
    check: bool = True,
) -> PackedBatch:
    """A micro-batch (a file path, the file's bytes, or a loaded ``treepack.MicroBatch``) as torch tensors on
    ``device`` (CPU when None). ``pin_memory`` stages through page-locked memory (a non-blocking copy to CUDA).
    Format, dtypes, shapes and (unless ``check=False``) the forest invariants are checked: TreepackError(E_INPUT)
    naming the field."""
    if isinstance(src, MicroBatch):
        return from_microbatch(src, device, pin_memory, check)
    file = "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
    return from_microbatch(load(src), device, pin_memory, check, file)


class PackedDataset(torch.utils.data.IterableDataset["PackedBatch"]):
    """The micro-batches of a packed directory in manifest order, as ``PackedBatch`` on CPU (move them, or let a
    DataLoader pin them). Files are resolved through manifest.json only (its ``micro_batches[i].file``).

    ``rank``/``dp`` select one data-parallel rank's share: the manifest's ``rank`` field when the directory was packed
    with ``--dp`` (the count must match), else every dp-th micro-batch. With DataLoader workers, each worker takes a
    disjoint share of that, so ``DataLoader(ds, batch_size=None, num_workers=k)`` yields each micro-batch once.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int | None = None, dp: int | None = None, check: bool = True):
        super().__init__()
        self.directory = os.fspath(directory)
        self.manifest = read_manifest(self.directory)
        self.check = check
        if (rank is None) != (dp is None):
            raise TreepackError("E_ARG", "give rank and dp together", field="rank" if rank is None else "dp")
        entries: list[dict[str, Any]] = self.manifest["micro_batches"]
        if dp is not None and rank is not None:
            if not (isinstance(dp, int) and dp >= 1):
                raise TreepackError("E_ARG", f"dp must be an integer >= 1, got {dp!r}", field="dp")
            if not (isinstance(rank, int) and 0 <= rank < dp):
                raise TreepackError("E_ARG", f"rank must be an integer in [0, {dp}), got {rank!r}", field="rank")
            packed_dp = self.manifest.get("dp")
            if packed_dp is not None and packed_dp != dp:
                raise TreepackError("E_ARG", f"the directory was packed for dp = {packed_dp}, not {dp}", self.directory, "dp")
            if packed_dp is not None and all("rank" in e for e in entries):
                # a context-parallel group's micro-batch is listed under its first rank and run by every rank of cp_ranks
                entries = [e for e in entries if e["rank"] == rank or rank in e.get("cp_ranks", ())]
            else:
                entries = entries[rank::dp]
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def files(self) -> list[str]:
        """The micro-batch files, in manifest order (paths joined to the directory)."""
        return [os.path.join(self.directory, *e["file"].split("/")) for e in self.entries]

    def __iter__(self) -> Iterator[PackedBatch]:
        pairs = list(zip(self.files(), self.entries))
        info = torch.utils.data.get_worker_info()
        if info is not None:
            pairs = pairs[info.id :: info.num_workers]
        for path, entry in pairs:
            mb = load(path)
            check_entry(mb, entry, path)  # a file of another run must never reach the trainer
            yield from_microbatch(mb, None, False, self.check, path)
