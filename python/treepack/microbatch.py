"""Packed micro-batch files (shared/DESIGN.md §3) on the trainer side, with numpy only.

A micro-batch file is safetensors: an 8-byte little-endian header length n, n bytes of UTF-8 JSON naming each
tensor's dtype, shape and byte range, then the data. The file is memory-mapped and every tensor is a read-only
numpy view on the mapping, so loading costs no copy whatever the file size (copy an array to modify it).

The checks mirror src/io/microbatch.ts (shapes on load) and src/pack/invariants.ts (``check_invariants``).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np

FORMAT = "treepack/1"
MANIFEST_FILE = "manifest.json"

NODE_FIELDS = ("input_ids", "position_ids", "parent", "subtree_end")
OCCURRENCE_FLOAT_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
# Optional contract tensors: the floats, and the turn ids of turn-level aggregation (README format reference).
OPTIONAL_FIELDS = OCCURRENCE_FLOAT_FIELDS + ("turn_ids",)
_META_NUMBERS = ("num_sequences", "num_tokens_naive", "num_tokens_packed")

# Contract tensors and their dtypes; OPTIONAL_FIELDS may be absent.
_CONTRACT_DTYPES = {
    **{f: "I32" for f in NODE_FIELDS},
    "seq_offsets": "I32",
    "seq_positions": "I32",
    "loss_mask": "U8",
    **{f: "F32" for f in OCCURRENCE_FLOAT_FIELDS},
    "turn_ids": "I32",
}

# BF16 and F8 have no numpy dtype: they are carried as their raw bits.
_DTYPES = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
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
}

_HEADER = "__header__"
_METADATA = "__metadata__"

# A broken forest tends to break at every node: each kind of violation names its first few positions.
_EXAMPLES = 5


class TreepackError(ValueError):
    """Same codes and location as the TypeScript TreepackError: ``code`` (E_INPUT, E_IO, ...), ``file``, ``field``;
    ``reason`` is the message without the location."""

    def __init__(self, code: str, message: str, file: Optional[str] = None, field: Optional[str] = None):
        where = [w for w in (file, None if field is None else f"field {json.dumps(field)}") if w is not None]
        super().__init__((", ".join(where) + ": " if where else "") + message)
        self.code = code
        self.reason = message
        self.file = file
        self.field = field


class SafetensorsFile(NamedTuple):
    tensors: Dict[str, np.ndarray]
    dtypes: Dict[str, str]  # the safetensors dtype names (BF16 and F8 arrays are raw bits)
    metadata: Dict[str, str]


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


def _source(src: Source) -> Tuple[Any, int, str]:
    """(buffer, size, name for errors): a file is memory-mapped; bytes are read in place ("<bytes>")."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        buf = memoryview(src).cast("B")
        if buf.nbytes < 8:
            raise TreepackError("E_INPUT", f"buffer is {buf.nbytes} bytes, shorter than the 8-byte header length", "<bytes>", _HEADER)
        return buf, buf.nbytes, "<bytes>"
    path = os.fspath(src)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise TreepackError("E_INPUT", f"file is {size} bytes, shorter than the 8-byte header length", path, _HEADER)
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size, path
    except OSError as e:
        raise TreepackError("E_IO", str(e), path) from e


def read_safetensors(src: Source) -> SafetensorsFile:
    """Reads any safetensors file (a path, or its bytes); each inconsistency is a TreepackError(E_INPUT) naming the
    tensor."""
    buf, size, path = _source(src)

    def bad(fld: str, message: str) -> TreepackError:
        return TreepackError("E_INPUT", message, path, fld)

    n = int.from_bytes(buf[:8], "little")
    if n > size - 8:
        raise bad(_HEADER, f"header length {n} runs past the end of the file ({size - 8} bytes after the length)")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(_HEADER, f"header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad(_HEADER, "header is not a JSON object")

    metadata: Dict[str, str] = {}
    raw_meta = header.get(_METADATA)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict):
            raise bad(_METADATA, f"{_METADATA} is not an object")
        for k, v in raw_meta.items():
            if not isinstance(v, str):
                raise bad(k, f"metadata value {json.dumps(k)} is not a string")
            metadata[k] = v

    start = 8 + n
    data_len = size - start
    tensors: Dict[str, np.ndarray] = {}
    dtypes: Dict[str, str] = {}
    spans = []
    for name, info in header.items():
        if name == _METADATA:
            continue
        label = f"tensor {json.dumps(name)}"
        if not isinstance(info, dict):
            raise bad(name, f"{label}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise bad(name, f"{label}: unknown dtype {json.dumps(dtype)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(name, f"{label}: shape {json.dumps(shape)} is not a list of non-negative integers")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets) and offsets[0] <= offsets[1]
        ):
            raise bad(name, f"{label}: data_offsets {json.dumps(offsets)} is not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if end > data_len:
            raise bad(name, f"{label}: data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes; file truncated?)")
        dt = _DTYPES[dtype]
        count = math.prod(shape)
        if end - begin != count * dt.itemsize:
            raise bad(
                name, f"{label}: shape {json.dumps(shape)} of {dtype} needs {count * dt.itemsize} bytes but data_offsets span {end - begin}"
            )
        spans.append((begin, end, name))
        if count == 0:
            arr = np.empty(shape, dtype=dt)
        else:
            arr = np.frombuffer(buf, dtype=dt, count=count, offset=start + begin).reshape(shape)
        tensors[name] = arr
        dtypes[name] = dtype
    spans.sort()
    for (pb, pe, pname), (b, e, name) in zip(spans, spans[1:]):
        if b < pe:
            raise bad(name, f"tensor {json.dumps(name)}: data_offsets [{b}, {e}] overlap tensor {json.dumps(pname)} [{pb}, {pe}]")
    return SafetensorsFile(tensors, dtypes, metadata)


@dataclass
class MicroBatch:
    """One packed micro-batch; field names and meanings are the contract's (DESIGN §3)."""

    input_ids: np.ndarray  # int32 [N]
    position_ids: np.ndarray  # int32 [N]
    parent: np.ndarray  # int32 [N], -1 for a root
    subtree_end: np.ndarray  # int32 [N]
    seq_offsets: np.ndarray  # int32 [S+1]
    seq_positions: np.ndarray  # int32 [M]
    loss_mask: np.ndarray  # uint8 [M]
    meta: Dict[str, Any]  # numbers as int, sequence_ids as a list; other keys as stored
    extra: Dict[str, np.ndarray] = field(default_factory=dict)  # tensors outside the contract
    advantages: Optional[np.ndarray] = None  # float32 [M]
    old_logprobs: Optional[np.ndarray] = None
    ref_logprobs: Optional[np.ndarray] = None
    rollout_logprobs: Optional[np.ndarray] = None
    turn_ids: Optional[np.ndarray] = None  # int32 [M], never decreasing along a sequence

    @property
    def num_sequences(self) -> int:
        return len(self.seq_offsets) - 1

    def sequence(self, i: int) -> np.ndarray:
        """Tokens of sequence i, gathered from the packed stream (DESIGN §7 invariant 1)."""
        if not 0 <= i < self.num_sequences:
            raise TreepackError("E_INPUT", f"sequence {i} is out of range: the micro-batch has S = {self.num_sequences} sequences", field="seq_offsets")
        return self.input_ids[self.seq_positions[self.seq_offsets[i] : self.seq_offsets[i + 1]]]


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
    meta: Dict[str, Any] = dict(md)
    for key in _META_NUMBERS:
        s = md.get(key)
        if s is None or not re.fullmatch(r"0|[1-9][0-9]*", s):
            raise fail(key, f"{key} is {'missing' if s is None else json.dumps(s)}, expected a non-negative integer")
        meta[key] = int(s)
    pad = md.get("num_pad_tokens")
    if pad is not None:
        # Extension (micro-batching under a token budget): the last num_pad_tokens nodes are padding roots.
        if not re.fullmatch(r"0|[1-9][0-9]*", pad) or int(pad) > meta["num_tokens_packed"]:
            raise fail("num_pad_tokens", f"num_pad_tokens is {json.dumps(pad)}, expected an integer in [0, N = {meta['num_tokens_packed']}]")
        meta["num_pad_tokens"] = int(pad)
    if "tokenizer" not in md:
        raise fail("tokenizer", "tokenizer is missing")
    try:
        meta["sequence_ids"] = json.loads(md.get("sequence_ids", "null"))
    except ValueError:
        raise fail("sequence_ids", "sequence_ids is not JSON") from None

    fields: Dict[str, np.ndarray] = {}
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
    extra = {k: v for k, v in st.tensors.items() if k not in _CONTRACT_DTYPES}
    mb = MicroBatch(meta=meta, extra=extra, **fields)
    _check_shapes(mb, fail)
    return mb


def _report(out: List[str], mask: np.ndarray, what: str, describe: Callable[[int], str]) -> None:
    idx = np.flatnonzero(mask)
    if idx.size:
        examples = "; ".join(describe(int(i)) for i in idx[:_EXAMPLES])
        more = "; …" if idx.size > _EXAMPLES else ""
        out.append(f"{what} ({idx.size}): {examples}{more}")


def check_invariants(mb: MicroBatch) -> List[str]:
    """DESIGN §7 invariants 1, 2 and 4, vectorised; an empty list when the micro-batch is valid.

    Node checks: parent before child, position_ids = depth, and subtree_end exact. [p, subtree_end[p]) is
    exactly p's subtree (the attention rule ``k <= q < subtree_end[k]``) iff every child's interval nests in
    its parent's and each interval's length is 1 + the sum of its children's lengths: nesting puts every
    descendant inside, the lengths leave room for nothing else. Occurrence checks: seq_offsets is CSR,
    seq_positions in range, parent[seq_positions[t]] = seq_positions[t-1] (-1 at t = 0),
    position_ids[seq_positions[t]] = t, loss_mask 0 at t = 0, turn_ids (when present) never decreasing along a
    sequence.
    """
    out: List[str] = []
    N, M = len(mb.input_ids), len(mb.seq_positions)
    for f in NODE_FIELDS[1:]:
        if len(getattr(mb, f)) != N:
            out.append(f"{f} has {len(getattr(mb, f))} elements: expected N = {N} (length of input_ids)")
    if out:
        return out
    pos = mb.position_ids.astype(np.int64)
    parent = mb.parent.astype(np.int64)
    end = mb.subtree_end.astype(np.int64)
    nodes = np.arange(N, dtype=np.int64)

    bad_parent = (parent < -1) | (parent >= nodes)
    _report(out, bad_parent, "parent not -1 or a position before the node", lambda p: f"parent[{p}] = {parent[p]}")
    child = ~bad_parent & (parent >= 0)
    q = np.where(child, parent, 0)
    depth = np.where(child, pos[q] + 1, 0)
    _report(
        out,
        ~bad_parent & (pos != depth),
        "position_ids not the depth",
        lambda p: f"position_ids[{p}] = {pos[p]}, expected {depth[p]}",
    )
    if not bad_parent.any():
        size = end - nodes
        children = np.zeros(N, dtype=np.int64)
        np.add.at(children, parent[child], size[child])
        _report(
            out,
            (size < 1) | (end > N),
            "subtree_end out of (p, N]",
            lambda p: f"subtree_end[{p}] = {end[p]}",
        )
        _report(
            out,
            child & (end > end[q]),
            "subtree_end past the parent's",
            lambda p: f"subtree_end[{p}] = {end[p]} > subtree_end[{parent[p]}] = {end[parent[p]]}",
        )
        _report(
            out,
            size != 1 + children,
            "subtree_end not 1 + the children's subtrees (or layout not a DFS preorder)",
            lambda p: f"subtree_end[{p}] = {end[p]}, children's subtrees cover {children[p]}",
        )

    S = len(mb.seq_offsets) - 1
    for f in ("loss_mask",) + OPTIONAL_FIELDS:
        a = getattr(mb, f)
        if a is not None and len(a) != M:
            out.append(f"{f} has {len(a)} elements: expected M = {M} (length of seq_positions)")
    if S < 0:
        out.append("seq_offsets is empty: expected S+1 >= 1 entries")
        return out
    off = mb.seq_offsets.astype(np.int64)
    csr_ok = off[0] == 0 and off[S] == M and not (np.diff(off) < 0).any()
    if not csr_ok:
        out.append(f"seq_offsets is not CSR offsets of M = {M} occurrences: starts at {off[0]}, ends at {off[S]}")
        return out
    lengths = np.diff(off)
    t = np.arange(M, dtype=np.int64) - np.repeat(off[:-1], lengths)
    seq = np.repeat(np.arange(S), lengths)
    sp = mb.seq_positions.astype(np.int64)

    def at(k: int) -> str:
        return f"(sequence {seq[k]}, t = {t[k]})"

    if len(mb.loss_mask) == M:
        _report(
            out,
            (t == 0) & (mb.loss_mask != 0),
            "loss_mask not 0 at t = 0",
            lambda k: f"loss_mask[{k}] = {mb.loss_mask[k]} {at(k)}",
        )
    in_range = (sp >= 0) & (sp < N)
    _report(out, ~in_range, f"seq_positions not in [0, {N})", lambda k: f"seq_positions[{k}] = {sp[k]} {at(k)}")
    p = np.where(in_range, sp, 0)
    prev = np.full(M, -1, dtype=np.int64)
    prev[1:] = sp[:-1]
    prev[t == 0] = -1
    # With N = 0 every occurrence is out of range and p (all zeros) must not index the empty node arrays.
    node_parent = parent[p] if N else prev
    node_pos = pos[p] if N else t
    _report(
        out,
        in_range & (node_parent != prev),
        "parent[seq_positions[k]] not seq_positions[k-1] (-1 at t = 0)",
        lambda k: f"parent[{sp[k]}] = {node_parent[k]}, expected {prev[k]} {at(k)}",
    )
    _report(
        out,
        in_range & (node_pos != t),
        "position_ids[seq_positions[k]] not t",
        lambda k: f"position_ids[{sp[k]}] = {node_pos[k]}, expected {t[k]} {at(k)}",
    )
    if mb.turn_ids is not None and len(mb.turn_ids) == M:
        turn = mb.turn_ids.astype(np.int64)
        down = np.zeros(M, dtype=bool)
        down[1:] = turn[1:] < turn[:-1]
        _report(out, down & (t > 0), "turn_ids decreasing along a sequence", lambda k: f"turn_ids[{k}] = {turn[k]} < {turn[k - 1]} {at(k)}")
    return out


def check_values(mb: MicroBatch, vocab_size: Optional[int] = None) -> List[str]:
    """What the trainer would read wrong without failing: loss_mask other than 0/1 (a 7 counts as trainable),
    input_ids < 0 or >= vocab_size (when known; an embedding lookup out of range), and non-finite advantages or
    logprobs at trainable occurrences (masked ones never enter the loss). Empty when the values are valid."""
    out: List[str] = []
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
            _report(out, trainable & ~np.isfinite(a), f"{f} not finite at a trainable occurrence", lambda k, a=a, f=f: f"{f}[{k}] = {a[k]}")
    return out


def read_manifest(directory: str) -> Dict[str, Any]:
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
    for i, e in enumerate(entries):
        at = f"micro_batches[{i}]"
        if not isinstance(e, dict):
            raise fail(at, f"{at} is not an object")
        f = e.get("file")
        parts = f.split("/") if isinstance(f, str) else []
        if not parts or any(p in ("", ".", "..") for p in parts) or "\\" in f or os.path.isabs(f):
            raise fail(f"{at}.file", f"{at}.file is {json.dumps(f)}, expected a relative path inside the directory")
        for k in ("sequences", "naive_tokens", "packed_tokens"):
            if not _is_count(e.get(k)):
                raise fail(f"{at}.{k}", f"{at}.{k} is {json.dumps(e.get(k))}, expected an integer >= 0")
    return doc


def list_microbatches(directory: str) -> List[str]:
    """Paths of the micro-batch files ``directory``'s committed manifest names, in manifest order
    (``os.path.join(directory, entry["file"])`` for each entry). The way to enumerate a packed directory."""
    directory = os.fspath(directory)
    return [os.path.join(directory, *e["file"].split("/")) for e in read_manifest(directory)["micro_batches"]]


def check_entry(mb: MicroBatch, entry: Dict[str, Any], path: str) -> None:
    """Raises E_INPUT if a loaded file disagrees with its manifest entry (a file of another run)."""
    for k, key in (("sequences", "num_sequences"), ("naive_tokens", "num_tokens_naive"), ("packed_tokens", "num_tokens_packed")):
        if mb.meta[key] != entry[k]:
            raise TreepackError(
                "E_INPUT", f"the manifest says {k} = {entry[k]} but the file has {mb.meta[key]} (a file of another run?)", path, k
            )
