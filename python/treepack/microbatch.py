"""Packed micro-batch files (docs/design.md §3) on the trainer side, as numpy arrays.

A micro-batch file is safetensors, read with the ``safetensors`` library (the format's reference implementation),
which refuses what the format does not allow; every tensor is a read-only numpy view on the bytes it returns. On
top, ``load`` checks the contract: format, dtypes, lengths and metadata (as src/io/microbatch.ts does), and
``check_invariants`` the forest, through the C core (``tp_forest_check``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Union

import numpy as np

from . import _abi, _native
from .errors import TreepackError as TreepackError  # re-exported: the trainer side imports it from here

FORMAT = "treepack/1"
MANIFEST_FILE = "manifest.json"

NODE_FIELDS = ("input_ids", "position_ids", "parent", "subtree_end")
OCCURRENCE_FLOAT_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
# Optional contract tensors: the floats, and the turn ids of turn-level aggregation (docs/reference/format.md).
OPTIONAL_FIELDS = OCCURRENCE_FLOAT_FIELDS + ("turn_ids",)
_META_NUMBERS = ("num_sequences", "num_tokens_naive", "num_tokens_packed")
# Optional image tensors (docs/reference/format.md, "Images"): present together when the micro-batch has images;
# mrope_position_ids may come alone (a vision-language model's text-only micro-batch). name -> (dtype, ndim).
IMAGE_FIELDS = {"image_pixels": ("U8", 1), "image_sizes": ("I32", 2), "image_grid_thw": ("I32", 3), "image_fills": ("I32", 4)}
_MROPE = "mrope_position_ids"

# Contract tensors and their dtypes; OPTIONAL_FIELDS may be absent.
_CONTRACT_DTYPES = {
    **{f: "I32" for f in NODE_FIELDS},
    "seq_offsets": "I32",
    "seq_positions": "I32",
    "loss_mask": "U8",
    **{f: "F32" for f in OCCURRENCE_FLOAT_FIELDS},
    "turn_ids": "I32",
}

# The numpy dtype of each safetensors dtype; BF16 and the 8-bit floats have none: they are carried as their raw bits.
_DTYPES = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
    "F8_E4M3FNUZ": np.dtype("u1"),
    "F8_E5M2FNUZ": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
}

_HEADER = "__header__"
_METADATA = "__metadata__"

# A broken forest tends to break at every node: each kind of violation names its first few positions.
_EXAMPLES = 5


class SafetensorsFile(NamedTuple):
    """A safetensors file as read: ``tensors`` by name (numpy arrays), their safetensors ``dtypes`` and the header
    ``metadata`` (strings)."""

    tensors: dict[str, np.ndarray]
    dtypes: dict[str, str]  # the safetensors dtype names (BF16 and F8 arrays are raw bits)
    metadata: dict[str, str]


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


def _diagnose(data: bytes) -> tuple[str, str] | None:
    """(field, message) naming the tensor or metadata key at fault in a file the library refused, when the header
    parses: the library's message does not always say which one."""
    n = int.from_bytes(data[:8], "little")
    if len(data) >= 8 and n > len(data) - 8:
        return _HEADER, f"header length {n} runs past the end of the file ({len(data) - 8} bytes after the length)"
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    meta = header.get(_METADATA)
    for k, v in meta.items() if isinstance(meta, dict) else ():
        if not isinstance(v, str):
            return k, f"metadata value {json.dumps(k)} is not a string"
    data_len = len(data) - 8 - n
    for name, info in header.items():
        if name == _METADATA or not isinstance(info, dict):
            continue
        label = f"tensor {json.dumps(name)}"
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            return name, f"{label}: unknown dtype {json.dumps(dtype)}"
        if not (
            isinstance(shape, list)
            and all(_is_count(d) for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(x) for x in offsets)
        ):
            continue
        begin, end = offsets
        need = math.prod(shape) * _DTYPES[dtype].itemsize
        if end - begin != need:
            return name, f"{label}: shape {json.dumps(shape)} of {dtype} needs {need} bytes but data_offsets span {end - begin}"
        if end > data_len:
            return name, f"{label}: data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes; file truncated?)"
    return None


def read_safetensors(src: Source) -> SafetensorsFile:
    """Reads any safetensors file (a path, or its bytes) with the safetensors library; a file it refuses is a
    TreepackError(E_INPUT) naming the tensor at fault where it can be told."""
    # Imported here, its only user: packing, the checks and the loss need numpy alone.
    import safetensors

    if isinstance(src, (bytes, bytearray, memoryview)):
        data, path = bytes(src), "<bytes>"
    else:
        path = os.fspath(src)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise TreepackError("E_IO", str(e), path) from e
    try:
        entries = safetensors.deserialize(data)
    except safetensors.SafetensorError as e:
        # The library names a tensor only for bad offsets (`name`); otherwise look for the one at fault.
        named = re.search(r"for tensor `(.+)`", str(e))
        fld, message = (named.group(1), str(e)) if named else _diagnose(data) or (_HEADER, str(e))
        raise TreepackError("E_INPUT", f"not a valid safetensors file ({len(data)} bytes): {message}", path, fld) from None
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, info in entries:
        dtype = info["dtype"]
        if dtype not in _DTYPES:
            raise TreepackError("E_INPUT", f"tensor {json.dumps(name)}: dtype {dtype} has no numpy equivalent", path, name)
        arr = np.frombuffer(info["data"], dtype=_DTYPES[dtype]).reshape(info["shape"])
        arr.flags.writeable = False  # as documented: the loader's arrays are read-only, copy one to modify it
        tensors[name] = arr
        dtypes[name] = dtype
    # The library has checked the header; it hands tensors, not metadata, back from bytes.
    n = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + n].decode("utf-8")).get(_METADATA) or {}
    return SafetensorsFile(tensors, dtypes, metadata)


@dataclass
class MicroBatch:
    """One packed micro-batch; field names and meanings are the contract's (docs/design.md §3)."""

    input_ids: np.ndarray  # int32 [N]
    position_ids: np.ndarray  # int32 [N]
    parent: np.ndarray  # int32 [N], -1 for a root
    subtree_end: np.ndarray  # int32 [N]
    seq_offsets: np.ndarray  # int32 [S+1]
    seq_positions: np.ndarray  # int32 [M]
    loss_mask: np.ndarray  # uint8 [M]
    meta: dict[str, Any]  # numbers as int, sequence_ids as a list; other keys as stored
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # tensors outside the contract
    advantages: np.ndarray | None = None  # float32 [M]
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    rollout_logprobs: np.ndarray | None = None
    turn_ids: np.ndarray | None = None  # int32 [M], never decreasing along a sequence
    routes: np.ndarray | None = None  # int16 [N, layers, k]: per node, the experts an MoE engine routed it to; -1: none
    image_pixels: np.ndarray | None = None  # uint8 [B]: each distinct image's decoded RGB bytes (H×W×3, row-major), in order
    image_sizes: np.ndarray | None = None  # int32 [I, 2]: (height, width) of each image
    image_grid_thw: np.ndarray | None = None  # int32 [I, 3]: the processor's grid (t, h, w in patches)
    image_fills: np.ndarray | None = None  # int32 [F, 4]: (image, first node, first placeholder, count)
    mrope_position_ids: np.ndarray | None = None  # int32 [3, N]: temporal, height, width rotary positions per node

    @property
    def num_sequences(self) -> int:
        """S, the number of sequences (``len(seq_offsets) - 1``)."""
        return len(self.seq_offsets) - 1

    def sequence(self, i: int) -> np.ndarray:
        """Tokens of sequence i, gathered from the packed stream (docs/design.md §7 invariant 1)."""
        if not 0 <= i < self.num_sequences:
            raise TreepackError(
                "E_INPUT", f"sequence {i} is out of range: the micro-batch has S = {self.num_sequences} sequences", field="seq_offsets"
            )
        tokens: np.ndarray = self.input_ids[self.seq_positions[self.seq_offsets[i] : self.seq_offsets[i + 1]]]
        return tokens

    @property
    def num_images(self) -> int:
        """I, the number of distinct images (0 without images)."""
        return 0 if self.image_sizes is None else len(self.image_sizes)

    def image(self, i: int) -> np.ndarray:
        """Image i's decoded pixels, uint8 [H, W, 3] (a view on ``image_pixels``)."""
        if not 0 <= i < self.num_images:
            raise TreepackError(
                "E_INPUT", f"image {i} is out of range: the micro-batch has I = {self.num_images} images", field="image_sizes"
            )
        assert self.image_sizes is not None and self.image_pixels is not None
        sizes = self.image_sizes.astype(np.int64)
        start = int((sizes[:i, 0] * sizes[:i, 1]).sum()) * 3
        h, w = (int(x) for x in sizes[i])
        return self.image_pixels[start : start + h * w * 3].reshape(h, w, 3)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) the Qwen2-VL family's image processor resizes an image to: multiples of ``factor`` (patch
    size × merge size) with an area in [min_pixels, max_pixels] and the aspect ratio kept as far as it can be
    (transformers' ``qwen2_vl.image_processing_qwen2_vl.smart_resize``, restated here so the checks need numpy only;
    python/tests/trainer/test_vision.py compares the two)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# The processor settings the checks read from the header's image_processor (the rest is the processor's business).
PROCESSOR_KEYS = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_token_id")


def expected_grid(processor: dict[str, Any], height: int, width: int) -> tuple[int, int, int]:
    """The grid (t, h, w in patches) the processor makes of a still image of ``height`` × ``width`` pixels (one
    temporal patch: an image is repeated up to temporal_patch_size frames)."""
    patch, merge = int(processor["patch_size"]), int(processor["merge_size"])
    h, w = smart_resize(height, width, patch * merge, int(processor["min_pixels"]), int(processor["max_pixels"]))
    return 1, h // patch, w // patch


def placeholder_counts(mb: MicroBatch) -> np.ndarray:
    """int64 [I]: how many placeholder tokens each image expands to (t·h·w / merge_size²)."""
    if mb.image_grid_thw is None:
        return np.zeros(0, dtype=np.int64)
    merge = int(mb.meta["image_processor"]["merge_size"])
    counts: np.ndarray = np.prod(mb.image_grid_thw.astype(np.int64), axis=1) // (merge * merge)
    return counts


def check_images(mb: MicroBatch) -> list[str]:
    """The image tensors' invariants (docs/reference/format.md, "Images"); empty when valid or when there are none:
    pixel bytes = Σ H·W·3, grids = the processor's smart_resize of the sizes, fills inside [0, N) and inside their
    image's placeholders, each fill a chain (node k's parent is node k - 1), the filled nodes exactly the nodes whose
    input_ids is image_token_id (each once), and mrope_position_ids [3, N]."""
    out: list[str] = []
    N = len(mb.input_ids)
    if mb.mrope_position_ids is not None and mb.mrope_position_ids.shape != (3, N):
        out.append(f"mrope_position_ids has shape {list(mb.mrope_position_ids.shape)}: expected [3, N = {N}]")
    if mb.image_fills is None or mb.image_sizes is None or mb.image_grid_thw is None or mb.image_pixels is None:
        return out
    proc = mb.meta.get("image_processor")
    if not isinstance(proc, dict) or any(k not in proc for k in PROCESSOR_KEYS):
        return out + [f"image_processor (metadata) missing or without {', '.join(PROCESSOR_KEYS)}: the images cannot be checked"]
    n_images, F = len(mb.image_sizes), len(mb.image_fills)
    if len(mb.image_grid_thw) != n_images:
        return out + [f"image_grid_thw has {len(mb.image_grid_thw)} rows: expected I = {n_images} (rows of image_sizes)"]
    sizes = mb.image_sizes.astype(np.int64)
    if (sizes <= 0).any():
        return out + [f"image_sizes not positive: image {int(np.flatnonzero((sizes <= 0).any(1))[0])}"]
    need = int((sizes[:, 0] * sizes[:, 1]).sum()) * 3
    if len(mb.image_pixels) != need:
        out.append(f"image_pixels has {len(mb.image_pixels)} bytes: expected {need} (the sum of H·W·3 over image_sizes)")
    hashes = mb.meta.get("image_hashes")

    def name(i: int) -> str:
        return f"image {i}" + (f" ({hashes[i]})" if isinstance(hashes, list) and i < len(hashes) else "")

    grid = mb.image_grid_thw.astype(np.int64)
    for i in range(n_images):
        try:
            want = expected_grid(proc, int(sizes[i, 0]), int(sizes[i, 1]))
        except ValueError as e:
            out.append(f"image_sizes: {name(i)} cannot be resized: {e}")
            continue
        if tuple(int(x) for x in grid[i]) != want:
            out.append(f"image_grid_thw of {name(i)} is {grid[i].tolist()}, but the processor makes {list(want)} of {sizes[i].tolist()}")
    if out:
        return out
    fills = mb.image_fills.astype(np.int64)
    counts = placeholder_counts(mb)
    img, pos, first, count = (fills[:, k] for k in range(4)) if F else (np.zeros(0, np.int64),) * 4
    bad = (img < 0) | (img >= n_images) | (count <= 0) | (pos < 0) | (pos + count > N) | (first < 0)
    _report(out, bad, "image_fills out of range", lambda f: f"image_fills[{f}] = {fills[f].tolist()} (I = {n_images}, N = {N})")
    if out:
        return out
    _report(
        out,
        first + count > counts[img],
        "image_fills past their image's placeholders",
        lambda f: f"image_fills[{f}] = {fills[f].tolist()}: {name(int(img[f]))} has {counts[img[f]]} placeholders",
    )
    covered = np.zeros(N, dtype=np.int64)
    nodes = np.concatenate([np.arange(p, p + c) for p, c in zip(pos, count)]) if F else np.zeros(0, np.int64)
    np.add.at(covered, nodes, 1)
    first_nodes = np.repeat(pos, count)
    inner = nodes[nodes != first_nodes]
    parent = mb.parent.astype(np.int64)
    broken = inner[parent[inner] != inner - 1]
    if broken.size:
        out.append(f"image_fills not a chain ({broken.size}): node {int(broken[0])}'s parent is {int(parent[broken[0]])}")
    token = int(proc["image_token_id"])
    is_placeholder = mb.input_ids == token
    _report(out, covered > 1, "image_fills overlap", lambda p: f"node {p} is filled {covered[p]} times")
    _report(
        out,
        (covered > 0) & ~is_placeholder,
        f"image_fills over nodes that are not image_token_id {token}",
        lambda p: f"input_ids[{p}] = {mb.input_ids[p]}",
    )
    _report(out, (covered == 0) & is_placeholder, f"image_fills miss nodes of image_token_id {token}", lambda p: f"node {p}")
    if out or mb.mrope_position_ids is None:
        return out
    node_img = np.full(N, -1, dtype=np.int64)
    node_ph = np.zeros(N, dtype=np.int64)
    node_img[nodes] = np.repeat(img, count)
    node_ph[nodes] = np.repeat(first, count) + np.arange(len(nodes)) - starts_of(count)
    merged = np.concatenate([grid[:, :1], grid[:, 1:] // int(proc["merge_size"])], axis=1)  # t, then rows and columns merged
    _check_mrope(out, mb, node_img, node_ph, merged, name)
    return out


def starts_of(count: np.ndarray) -> np.ndarray:
    """Each element's run start in a concatenation of runs of these lengths (``np.repeat(cumsum - count, count)``)."""
    return np.repeat(np.cumsum(count) - count, count)


def _check_mrope(
    out: list[str], mb: MicroBatch, node_img: np.ndarray, node_ph: np.ndarray, merged: np.ndarray, name: Callable[[int], str]
) -> None:
    """mrope_position_ids by the Qwen2-VL rules (transformers' get_rope_index for images), node by node from its
    parent's (so by induction from the roots): a text node is (n, n, n) where n is the position after its parent (0
    at a root; a text parent's + 1; an image's start + max(rows, columns) of its merged grid after its last
    placeholder); placeholder j of an image starting at s, on a merged grid of w columns, is (s, s + j // w, s + j % w),
    its first placeholder starting at the position after its parent and every other one following the previous."""
    assert mb.mrope_position_ids is not None
    pos = mb.mrope_position_ids.astype(np.int64)
    parent = mb.parent.astype(np.int64)
    q = np.maximum(parent, 0)
    root = parent < 0
    is_img = node_img >= 0
    img = np.maximum(node_img, 0)
    rows, cols = merged[img, 1], merged[img, 2]
    t_img = merged[img, 0]
    if (t_img[is_img] != 1).any():
        p = int(np.flatnonzero(is_img & (t_img != 1))[0])
        out.append(f"mrope_position_ids: {name(int(node_img[p]))} has {t_img[p]} temporal patches: only still images are checked")
        return
    # The position after each node: text n + 1; an image's last placeholder start + max(rows, columns); else -1 (none).
    last = is_img & (node_ph == rows * cols - 1)
    after = np.where(is_img, np.where(last, pos[0] + np.maximum(rows, cols), -1), pos[0] + 1)
    nxt = np.where(root, 0, after[q])
    continues = is_img & (node_ph > 0)
    start = np.where(continues, pos[0, q], nxt)
    want = np.where(is_img, np.stack([start, start + node_ph // np.maximum(cols, 1), start + node_ph % np.maximum(cols, 1)]), nxt)
    ok_parent = ~continues | (~root & (node_img[q] == node_img) & (node_ph[q] == node_ph - 1))
    bad = (want != pos).any(0) | ((nxt < 0) & ~continues) | ~ok_parent
    _report(
        out,
        bad,
        "mrope_position_ids not by the get_rope_index rules",
        lambda p: f"mrope_position_ids[:, {p}] = {pos[:, p].tolist()}, expected {want[:, p].tolist()}",
    )


def _check_shapes(mb: MicroBatch, fail: Callable[[str, str], TreepackError]) -> None:
    N, M, S = len(mb.input_ids), len(mb.seq_positions), len(mb.seq_offsets) - 1
    if S < 0:
        raise fail("seq_offsets", "seq_offsets is empty; it needs S+1 >= 1 entries")
    for f in NODE_FIELDS:
        if len(getattr(mb, f)) != N:
            raise fail(f, f"{f} has {len(getattr(mb, f))} elements but input_ids has N = {N}")
    for f in ("loss_mask",) + OPTIONAL_FIELDS:
        a = getattr(mb, f)
        if a is not None and len(a) != M:
            raise fail(f, f"{f} has {len(a)} elements but seq_positions has M = {M}")
    for key, value in zip(_META_NUMBERS, (S, M, N)):
        if mb.meta[key] != value:
            raise fail(key, f"{key} = {mb.meta[key]} but the tensors say {value}")
    ids = mb.meta["sequence_ids"]
    if not isinstance(ids, list) or len(ids) != S or not all(isinstance(x, str) for x in ids):
        raise fail("sequence_ids", f"sequence_ids must be a list of {S} strings")
    off = mb.seq_offsets.astype(np.int64)
    if off[0] != 0:
        raise fail("seq_offsets", f"seq_offsets[0] = {off[0]}, expected 0")
    dec = np.flatnonzero(np.diff(off) < 0)
    if dec.size:
        i = int(dec[0])
        raise fail("seq_offsets", f"seq_offsets decreases at {i + 1}: {off[i]} > {off[i + 1]}")
    if off[S] != M:
        raise fail("seq_offsets", f"seq_offsets[S] = {off[S]} but seq_positions has M = {M} elements")
    shape = None if mb.routes is None else list(mb.routes.shape)
    want = [N, mb.meta.get("routes_layers"), mb.meta.get("routes_top_k")]
    if shape is None and want[1:] != [None, None]:
        raise fail("routes", "routes_layers and routes_top_k need the routes tensor (they go together)")
    if shape is not None and shape != want:
        raise fail("routes", f"tensor routes has shape {shape}, expected [N, routes_layers, routes_top_k] = {want}")


def load(src: Source) -> MicroBatch:
    """Loads a micro-batch (a file path, or the file's bytes), checking format, dtypes, lengths and metadata (not the
    forest invariants)."""
    path = "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)

    def fail(fld: str, message: str) -> TreepackError:
        return TreepackError("E_INPUT", message, path, fld)

    st = read_safetensors(src)
    md = st.metadata
    if md.get("format") != FORMAT:
        got = "missing" if "format" not in md else json.dumps(md["format"])
        raise fail("format", f"format is {got}, expected {json.dumps(FORMAT)}")
    meta: dict[str, Any] = dict(md)
    for key in _META_NUMBERS:
        s = md.get(key)
        if s is None or not re.fullmatch(r"0|[1-9][0-9]*", s):
            raise fail(key, f"{key} is {'missing' if s is None else json.dumps(s)}, expected a non-negative integer")
        meta[key] = int(s)
    pad = md.get("num_pad_tokens")
    if pad is not None:
        # Extension (micro-batching under a token budget): the last num_pad_tokens nodes are padding roots.
        if not re.fullmatch(r"0|[1-9][0-9]*", pad) or int(pad) > meta["num_tokens_packed"]:
            raise fail(
                "num_pad_tokens", f"num_pad_tokens is {json.dumps(pad)}, expected an integer in [0, N = {meta['num_tokens_packed']}]"
            )
        meta["num_pad_tokens"] = int(pad)
    vocab = md.get("vocab_size")
    if vocab is not None:
        # Extension: one past the largest id of the tokenizer that made the ids (a trainer checks its model against it).
        if not re.fullmatch(r"[1-9][0-9]*", vocab):
            raise fail("vocab_size", f"vocab_size is {json.dumps(vocab)}, expected a positive integer")
        meta["vocab_size"] = int(vocab)
    given = [k for k in ("prefix_tokens", "prefix_push", "prefix_release") if k in md]
    if given:
        # Extension (step plans, docs/concepts/micro-batching.md, "Step plans"): nodes [0, prefix_tokens) are a cached
        # chain; the stack operations.
        if len(given) != 3:
            raise fail(given[0], "prefix_tokens, prefix_push and prefix_release go together (a step plan entry)")
        for key in ("prefix_tokens", "prefix_release"):
            if not re.fullmatch(r"0|[1-9][0-9]*", md[key]):
                raise fail(key, f"{key} is {json.dumps(md[key])}, expected a non-negative integer")
            meta[key] = int(md[key])
        try:
            push = json.loads(md["prefix_push"])
        except ValueError:
            push = None
        h = meta["prefix_tokens"]
        ok = isinstance(push, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in push)
        if not ok or any(b <= a for a, b in zip([0] + push, push)) or (push and push[-1] != h) or h > meta["num_tokens_packed"]:
            raise fail("prefix_push", f"prefix_push is {md['prefix_push']}, expected ascending depths ending at prefix_tokens = {h} (<= N)")
        meta["prefix_push"] = push
    if "prefix_shared" in md:
        # Extension (shared prefixes, docs/design.md §11): per pushed segment, the shared piece it is, or null.
        shared = _json_or_none(md["prefix_shared"])
        if "prefix_push" not in meta or not _piece_ids(shared) or len(shared) != len(meta["prefix_push"]):
            raise fail(
                "prefix_shared",
                f"prefix_shared is {md['prefix_shared']}, expected one piece id (an integer >= 0) or null per prefix_push entry",
            )
        meta["prefix_shared"] = shared
    if "cp_ranks" in md:
        # Extension (context parallelism, docs/design.md §11): the ranks that run this micro-batch together.
        ranks = _json_or_none(md["cp_ranks"])
        if not _rank_list(ranks, 2):
            raise fail("cp_ranks", f"cp_ranks is {md['cp_ranks']}, expected two or more ascending rank numbers")
        meta["cp_ranks"] = ranks
    for key in ("routes_layers", "routes_top_k"):
        # Extension (MoE routing replay): the shape of the routes tensor.
        if key in md:
            if not re.fullmatch(r"[1-9][0-9]*", md[key]):
                raise fail(key, f"{key} is {json.dumps(md[key])}, expected a positive integer")
            meta[key] = int(md[key])
    if "tokenizer" not in md:
        raise fail("tokenizer", "tokenizer is missing")
    for key, kind in (("image_processor", dict), ("image_hashes", list)):
        if key in md:
            try:
                meta[key] = json.loads(md[key])
            except ValueError:
                meta[key] = None
            if not isinstance(meta[key], kind):
                raise fail(key, f"{key} is {md[key][:80]!r}, expected a JSON {'object' if kind is dict else 'list'}")
    try:
        meta["sequence_ids"] = json.loads(md.get("sequence_ids", "null"))
    except ValueError:
        raise fail("sequence_ids", "sequence_ids is not JSON") from None

    fields: dict[str, np.ndarray] = {}
    for name, dtype in _CONTRACT_DTYPES.items():
        if name not in st.tensors:
            if name in OPTIONAL_FIELDS:
                continue
            raise fail(name, f"required tensor {name} is missing")
        if st.dtypes[name] != dtype:
            raise fail(name, f"tensor {name} has dtype {st.dtypes[name]}, expected {dtype}")
        if st.tensors[name].ndim != 1:
            raise fail(name, f"tensor {name} has shape {list(st.tensors[name].shape)}, expected 1-D")
        fields[name] = st.tensors[name]
    if "routes" in st.tensors:
        if st.dtypes["routes"] != "I16":
            raise fail("routes", f"tensor routes has dtype {st.dtypes['routes']}, expected I16")
        fields["routes"] = st.tensors["routes"]
    _load_images(st, meta, fields, fail)
    extra = {k: v for k, v in st.tensors.items() if k not in _CONTRACT_DTYPES and k not in fields}
    mb = MicroBatch(meta=meta, extra=extra, **fields)
    _check_shapes(mb, fail)
    return mb


def _load_images(
    st: SafetensorsFile, meta: dict[str, Any], fields: dict[str, np.ndarray], fail: Callable[[str, str], TreepackError]
) -> None:
    """The optional image tensors into ``fields``: all four or none, with their dtypes and row widths, the header's
    image_processor (with the settings the checks read) and image_hashes (one per image) beside them."""
    given = [k for k in IMAGE_FIELDS if k in st.tensors]
    if given and len(given) != len(IMAGE_FIELDS):
        missing = next(k for k in IMAGE_FIELDS if k not in st.tensors)
        raise fail(missing, f"{missing} is missing: {', '.join(IMAGE_FIELDS)} go together (a micro-batch with images)")
    for name, (dtype, width) in list(IMAGE_FIELDS.items()) + [(_MROPE, ("I32", 0))]:
        if name not in st.tensors:
            continue
        a = st.tensors[name]
        if st.dtypes[name] != dtype:
            raise fail(name, f"tensor {name} has dtype {st.dtypes[name]}, expected {dtype}")
        want = "[B]" if width == 1 else "[3, N]" if name == _MROPE else f"[rows, {width}]"
        ok = a.ndim == 1 if width == 1 else a.ndim == 2 and (a.shape[0] == 3 if name == _MROPE else a.shape[1] == width)
        if not ok:
            raise fail(name, f"tensor {name} has shape {list(a.shape)}, expected {want}")
        fields[name] = a
    if not given:
        return
    proc = meta.get("image_processor")
    if proc is None:
        raise fail("image_processor", "image_processor is missing: a micro-batch with images names its processor settings")
    bad = [k for k in PROCESSOR_KEYS if not (isinstance(proc.get(k), int) and not isinstance(proc.get(k), bool) and proc[k] > 0)]
    if bad:
        raise fail("image_processor", f"image_processor.{bad[0]} is {json.dumps(proc.get(bad[0]))}, expected a positive integer")
    hashes = meta.get("image_hashes")
    n_images = len(fields["image_sizes"])
    if hashes is not None and (len(hashes) != n_images or not all(isinstance(h, str) for h in hashes)):
        raise fail("image_hashes", f"image_hashes must be a list of I = {n_images} strings (one per image)")


def _report(out: list[str], mask: np.ndarray, what: str, describe: Callable[[int], str]) -> None:
    idx = np.flatnonzero(mask)
    if idx.size:
        examples = "; ".join(describe(int(i)) for i in idx[:_EXAMPLES])
        more = "; …" if idx.size > _EXAMPLES else ""
        out.append(f"{what} ({idx.size}): {examples}{more}")


def check_invariants(mb: MicroBatch) -> list[str]:
    """docs/design.md §7 invariants 1, 2 and 4, and the padding of ``num_pad_tokens``; an empty list when the micro-batch is
    valid. The lengths are checked here, the rest by the C core's ``tp_forest_check``: parent before child,
    position_ids = depth, subtree_end = the end of each node's contiguous subtree (DFS preorder), seq_offsets CSR,
    and per occurrence seq_positions in range, parent[seq_positions[t]] = seq_positions[t-1] (-1 at t = 0),
    position_ids[seq_positions[t]] = t, loss_mask 0 at t = 0, turn_ids (when present) never decreasing along a
    sequence; and the image tensors when there are some (``check_images``). Each kind of violation is one line: its
    count and its first few examples.

        >>> import treepack
        >>> mb = treepack.pack_sequences([[1, 2], [1, 3]])   # nodes 1, 2, 3: 2 and 3 are children of 1
        >>> treepack.check_invariants(mb)
        []
        >>> mb.position_ids[2] = 2                            # node 2 is at depth 1
        >>> for line in treepack.check_invariants(mb): print(line)
        position_ids not the depth (1): position_ids[2] = 2, expected 1
        position_ids[seq_positions[k]] not t (1): position_ids[seq_positions[3]] = 2, expected 1 (sequence 1, t = 1)
    """
    out: list[str] = []
    N, M = len(mb.input_ids), len(mb.seq_positions)
    for f in NODE_FIELDS[1:]:
        if len(getattr(mb, f)) != N:
            out.append(f"{f} has {len(getattr(mb, f))} elements: expected N = {N} (length of input_ids)")
    if out:
        return out
    for f in ("loss_mask",) + OPTIONAL_FIELDS:
        a = getattr(mb, f)
        if a is not None and len(a) != M:
            out.append(f"{f} has {len(a)} elements: expected M = {M} (length of seq_positions)")
    S = len(mb.seq_offsets) - 1
    if S < 0:
        out.append("seq_offsets is empty: expected S+1 >= 1 entries")
        return out

    def i32(a: Any) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.int32)

    pos, parent, end, off, sp = (i32(a) for a in (mb.position_ids, mb.parent, mb.subtree_end, mb.seq_offsets, mb.seq_positions))
    mask = np.ascontiguousarray(mb.loss_mask, dtype=np.uint8) if len(mb.loss_mask) == M else None
    turns = i32(mb.turn_ids) if mb.turn_ids is not None and len(mb.turn_ids) == M else None
    pad = mb.meta.get("num_pad_tokens", 0) if isinstance(mb.meta, dict) else 0
    h = int(mb.meta.get("prefix_tokens", 0)) if isinstance(mb.meta, dict) else 0
    if h and (
        h > N or (np.asarray(mb.parent[:h]) != np.arange(-1, h - 1)).any() or (np.asarray(mb.position_ids[:h]) != np.arange(h)).any()
    ):
        out.append(
            f"prefix_tokens = {h}: nodes [0, {h}) are not a chain from a root (parent p - 1, position p), so they cannot be a cached prefix"
        )
    kinds = len(_abi.FOREST_CHECKS)
    counts = np.zeros(kinds, dtype=np.int64)
    examples = (_native.Violation * (kinds * _EXAMPLES))()
    a = _native.pointer
    rc = _native.core().tp_forest_check(
        a(pos), a(parent), a(end), N, pad, a(off), S, a(sp), a(mask), a(turns), M, _EXAMPLES, a(counts), examples
    )
    _native.check(rc, "tp_forest_check", "parent")
    for kind, (_, what, example) in enumerate(_abi.FOREST_CHECKS):
        count = int(counts[kind])
        if count:
            shown = [examples[kind * _EXAMPLES + i] for i in range(min(count, _EXAMPLES))]
            listed = "; ".join(example.format(**{f: getattr(v, f) for f in _abi.VIOLATION_FIELDS}) for v in shown)
            out.append(f"{what} ({count}): {listed}{'; …' if count > _EXAMPLES else ''}")
    if mb.routes is not None:
        _check_routes(mb.routes, N, out)
    return out + check_images(mb)


def _check_routes(routes: np.ndarray, N: int, out: list[str]) -> None:
    """The routes extension: [N, layers, k], each node's row all -1 (no occurrence routed) or, per layer, k distinct
    experts >= 0 (the same rules as src/io/microbatch.ts)."""
    if routes.ndim != 3 or routes.shape[0] != N:
        out.append(f"routes has shape {list(routes.shape)}: expected [N = {N}, layers, k]")
        return
    r = routes.astype(np.int64)
    unrouted = (r == -1).all(axis=(1, 2))
    _report(
        out,
        ~unrouted & (r < 0).any(axis=(1, 2)),
        "routes negative at a routed node (-1 only for a node no occurrence was routed at)",
        lambda p: f"routes[{p}] = {r[p].tolist()}",
    )
    s = np.sort(r, axis=-1)
    twice = ~unrouted & (s[..., 1:] == s[..., :-1]).any(axis=(1, 2))
    _report(out, twice, "routes give a node one expert twice in a layer", lambda p: f"routes[{p}] = {r[p].tolist()}")


def check_values(mb: MicroBatch, vocab_size: int | None = None) -> list[str]:
    """What the trainer would read wrong without failing: loss_mask other than 0/1 (a 7 counts as trainable),
    input_ids < 0 or >= vocab_size (when known; an embedding lookup out of range), and non-finite advantages or
    logprobs at trainable occurrences (masked ones never enter the loss). Empty when the values are valid."""
    out: list[str] = []
    ids = mb.input_ids.astype(np.int64)
    _report(out, ids < 0, "input_ids negative", lambda p: f"input_ids[{p}] = {ids[p]}")
    if vocab_size is not None:
        _report(out, ids >= vocab_size, f"input_ids not below the vocabulary size {vocab_size}", lambda p: f"input_ids[{p}] = {ids[p]}")
    mask = mb.loss_mask
    _report(out, mask > 1, "loss_mask not 0 or 1", lambda k: f"loss_mask[{k}] = {mask[k]}")
    M = len(mb.seq_positions)
    if len(mask) != M:
        return out
    trainable = mask != 0
    for f in OCCURRENCE_FLOAT_FIELDS:
        a = getattr(mb, f)
        if a is not None and len(a) == M:

            def value(k: int, a: np.ndarray = a, f: str = f) -> str:
                return f"{f}[{k}] = {a[k]}"

            _report(out, trainable & ~np.isfinite(a), f"{f} not finite at a trainable occurrence", value)
    return out


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _piece_ids(x: Any) -> bool:
    """A list of shared piece ids (integers >= 0) or nulls."""
    return isinstance(x, list) and all(e is None or (_is_int(e) and e >= 0) for e in x)


def _rank_list(x: Any, least: int) -> bool:
    """At least ``least`` ascending rank numbers."""
    return isinstance(x, list) and len(x) >= least and all(_is_int(r) and r >= 0 for r in x) and all(b > a for a, b in zip(x, x[1:]))


def _check_parallel(doc: dict[str, Any], fail: Callable[[str, str], TreepackError]) -> None:
    """The shared-prefix and planner extensions of a manifest (docs/design.md §11): each piece's group and ranges,
    each micro-batch's references to the pieces of its own window and group."""
    pieces = doc.get("shared_prefixes", [])
    if not isinstance(pieces, list):
        raise fail("shared_prefixes", "shared_prefixes is not a list")
    for i, p in enumerate(pieces):
        at = f"shared_prefixes[{i}]"
        if not isinstance(p, dict) or p.get("id") != i:
            raise fail(at, f"{at} is not an object with id = {i}")
        for k in ("step", "start", "end"):
            if not _is_count(p.get(k)):
                raise fail(f"{at}.{k}", f"{at}.{k} is {json.dumps(p.get(k))}, expected an integer >= 0")
        if not isinstance(p.get("sequence"), str):
            raise fail(f"{at}.sequence", f"{at}.sequence is {json.dumps(p.get('sequence'))}, expected a sequence id")
        start, end = p["start"], p["end"]
        ranks: Any = p.get("ranks")
        ranges: Any = p.get("ranges")
        if end <= start:
            raise fail(f"{at}.end", f"{at} covers [{start}, {end}), expected a non-empty depth range")
        if not _rank_list(ranks, 2) or any(b != a + 1 for a, b in zip(ranks, ranks[1:])):
            raise fail(f"{at}.ranks", f"{at}.ranks is {json.dumps(ranks)}, expected two or more consecutive rank numbers")
        dp = doc.get("dp")
        if _is_int(dp) and ranks[-1] >= dp:
            raise fail(f"{at}.ranks", f"{at}.ranks is {json.dumps(ranks)}, but dp = {dp}")
        ok = isinstance(ranges, list) and len(ranges) == len(ranks)
        bounds = [start]
        for r in ranges if ok else []:
            ok = ok and isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) and r[0] == bounds[-1] and r[1] >= r[0]
            bounds.append(r[1] if ok else -1)
        if not ok or bounds[-1] != end:
            raise fail(
                f"{at}.ranges", f"{at}.ranges is {json.dumps(ranges)}, expected one [a, b) per rank, contiguous, covering [{start}, {end})"
            )
    plans = doc.get("parallel_plans", [])
    if not isinstance(plans, list) or not all(
        isinstance(p, dict) and p.get("mode") in ("dp", "shared", "cp") and _is_int(p.get("cp")) and p["cp"] >= 1 for p in plans
    ):
        raise fail("parallel_plans", "parallel_plans is not a list of {mode: dp | shared | cp, cp: integer >= 1, ...}")
    for i, e in enumerate(doc["micro_batches"]):
        at = f"micro_batches[{i}]"
        if "prefix_shared" in e:
            shared, push = e["prefix_shared"], e.get("prefix_push")
            if not _piece_ids(shared) or not isinstance(push, list) or len(shared) != len(push):
                raise fail(
                    f"{at}.prefix_shared", f"{at}.prefix_shared is {json.dumps(shared)}, expected a piece id or null per prefix_push entry"
                )
            for j, pid in enumerate(shared):
                if pid is None:
                    continue
                if pid >= len(pieces):
                    raise fail(f"{at}.prefix_shared", f"{at}.prefix_shared[{j}] = {pid}, but shared_prefixes has {len(pieces)} pieces")
                p, start = pieces[pid], (push[j - 1] if j else None)
                if e.get("rank") not in p["ranks"] or push[j] != p["end"] or (start is not None and start != p["start"]):
                    raise fail(
                        f"{at}.prefix_shared",
                        f"{at}.prefix_shared[{j}] = {pid}: the piece covers [{p['start']}, {p['end']}) on ranks {p['ranks']}, "
                        f"but the segment ends at {push[j]} on rank {e.get('rank')}",
                    )
        if "cp_ranks" in e and (not _rank_list(e["cp_ranks"], 2) or e.get("rank") != e["cp_ranks"][0]):
            raise fail(
                f"{at}.cp_ranks", f"{at}.cp_ranks is {json.dumps(e['cp_ranks'])}, expected two or more ascending ranks, the first = rank"
            )


def read_manifest(directory: str) -> dict[str, Any]:
    """Reads ``<directory>/manifest.json``, the commit point of the run that wrote the directory, and checks it:
    format, and each ``micro_batches`` entry's ``file`` a relative path inside the directory with its counts.

    Only the files the manifest names belong to the committed run; others in the directory (the previous
    generation, a run in progress) must never be read, so a packed directory is never globbed.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST_FILE)

    def fail(fld: str, message: str) -> TreepackError:
        return TreepackError("E_INPUT", message, path, fld)

    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise TreepackError("E_IO", f"cannot read the manifest: {e.strerror}", path) from e
    try:
        doc = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TreepackError("E_INPUT", f"not UTF-8 JSON: {e}", path) from None
    if not isinstance(doc, dict):
        raise TreepackError("E_INPUT", "not a JSON object", path)
    if doc.get("format") != FORMAT:
        raise fail("format", f"format is {json.dumps(doc.get('format'))}, expected {json.dumps(FORMAT)}")
    entries = doc.get("micro_batches")
    if not isinstance(entries, list):
        raise fail("micro_batches", "micro_batches is not a list")
    for i, entry in enumerate(entries):
        at = f"micro_batches[{i}]"
        if not isinstance(entry, dict):
            raise fail(at, f"{at} is not an object")
        name = entry.get("file")
        if not isinstance(name, str) or any(p in ("", ".", "..") for p in name.split("/")) or "\\" in name or os.path.isabs(name):
            raise fail(f"{at}.file", f"{at}.file is {json.dumps(name)}, expected a relative path inside the directory")
        for k in ("sequences", "naive_tokens", "packed_tokens"):
            if not _is_count(entry.get(k)):
                raise fail(f"{at}.{k}", f"{at}.{k} is {json.dumps(entry.get(k))}, expected an integer >= 0")
    _check_parallel(doc, fail)
    return doc


def list_microbatches(directory: str, rank: int | None = None) -> list[str]:
    """Paths of the micro-batch files ``directory``'s committed manifest names, in manifest order
    (``os.path.join(directory, entry["file"])`` for each entry). The way to enumerate a packed directory.

    ``rank``: only those data-parallel rank ``rank`` runs, in its step order: the entries of that ``rank`` and those
    of the context-parallel groups it belongs to (``cp_ranks``: listed once, under the group's first rank, run by every
    rank of the group; docs/design.md §11). An entry without ``rank`` (packed without a budget) counts as rank 0's."""
    directory = os.fspath(directory)
    entries = read_manifest(directory)["micro_batches"]
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise TreepackError("E_ARG", f"rank must be an integer >= 0, got {rank!r}", directory, "rank")
        mine = [e for e in entries if e.get("rank", 0) == rank or rank in e.get("cp_ranks", ())]
        entries = sorted(mine, key=lambda e: int(e.get("step", 0)))
    return [os.path.join(directory, *e["file"].split("/")) for e in entries]


def check_entry(mb: MicroBatch, entry: dict[str, Any], path: str) -> None:
    """Raises E_INPUT if a loaded file disagrees with its manifest entry (a file of another run)."""
    for k, key in (("sequences", "num_sequences"), ("naive_tokens", "num_tokens_naive"), ("packed_tokens", "num_tokens_packed")):
        if mb.meta[key] != entry[k]:
            raise TreepackError(
                "E_INPUT", f"the manifest says {k} = {entry[k]} but the file has {mb.meta[key]} (a file of another run?)", path, k
            )
