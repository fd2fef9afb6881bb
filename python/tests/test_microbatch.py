"""Unit tests for the numpy reader and checker. Run from python/: ``python3 -m unittest discover -s tests``.

Files are built here by hand (header JSON + raw bytes), and forests by a plain dict trie, so nothing shares
code with the reader under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import tempfile
import unittest
from collections.abc import Sequence

import numpy as np
import treepack
from treepack.__main__ import main
from treepack.microbatch import TreepackError

SAFETENSORS_DTYPE = {np.dtype("<i4"): "I32", np.dtype("u1"): "U8", np.dtype("<f4"): "F32", np.dtype("<i8"): "I64"}


def safetensors_bytes(tensors: Sequence[tuple[str, str, np.ndarray]], metadata: dict[str, str] | None = None, gap: int = 0) -> bytes:
    """tensors as (name, dtype name, array) laid out in the given order, `gap` zero bytes before each."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, arr in tensors:
        data += b"\0" * gap
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js + data


def pack(seqs: list[list[int]]) -> dict[str, np.ndarray]:
    """The prefix forest in DFS preorder, children by ascending token."""
    trie: dict = {}
    for s in seqs:
        node = trie
        for tok in s:
            node = node.setdefault(tok, {})
    input_ids: list[int] = []
    position_ids: list[int] = []
    parent: list[int] = []
    subtree_end: list[int] = []
    where: dict[tuple[int, ...], int] = {}

    def visit(node: dict, par: int, depth: int, prefix: tuple[int, ...]) -> None:
        for tok in sorted(node):
            p = len(input_ids)
            input_ids.append(tok)
            position_ids.append(depth)
            parent.append(par)
            subtree_end.append(-1)
            where[prefix + (tok,)] = p
            visit(node[tok], p, depth + 1, prefix + (tok,))
            subtree_end[p] = len(input_ids)

    visit(trie, -1, 0, ())
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    positions = [where[tuple(s[: t + 1])] for s in seqs for t in range(len(s))]
    i32 = lambda xs: np.asarray(xs, dtype="<i4").reshape(-1)  # noqa: E731
    return {
        "input_ids": i32(input_ids),
        "position_ids": i32(position_ids),
        "parent": i32(parent),
        "subtree_end": i32(subtree_end),
        "seq_offsets": i32(offsets),
        "seq_positions": i32(positions),
    }


def micro_batch_tensors(seqs: list[list[int]], rnd: random.Random) -> tuple[list[tuple[str, str, np.ndarray]], dict[str, str]]:
    forest = pack(seqs)
    M = len(forest["seq_positions"])
    mask = np.array([0 if t == 0 else rnd.randint(0, 1) for s in seqs for t in range(len(s))], dtype="u1")
    arrays = dict(forest, loss_mask=mask, advantages=np.array([rnd.uniform(-1, 1) for _ in range(M)], dtype="<f4"))
    tensors = [(k, SAFETENSORS_DTYPE[v.dtype], v) for k, v in sorted(arrays.items())]
    meta = {
        "format": "treepack/1",
        "num_sequences": str(len(seqs)),
        "num_tokens_naive": str(M),
        "num_tokens_packed": str(len(forest["input_ids"])),
        "tokenizer": "t",
        "sequence_ids": json.dumps([f"id{i}" for i in range(len(seqs))]),
        "extra_key": "kept",
    }
    return tensors, meta


def random_seqs(rnd: random.Random, count: int = 12, max_len: int = 8, alphabet: int = 3) -> list[list[int]]:
    out: list[list[int]] = []
    for _ in range(count):
        if out and rnd.random() < 0.5:
            base = rnd.choice(out)
            s = base[: rnd.randint(0, len(base))] + [rnd.randrange(alphabet) for _ in range(rnd.randint(0, max_len))]
        else:
            s = [rnd.randrange(alphabet) for _ in range(rnd.randint(0, max_len))]
        out.append(s)
    return out


def brute_valid(mb: treepack.MicroBatch) -> bool:
    """The definition, pair by pair, for tiny forests."""
    par, pos, end = mb.parent.tolist(), mb.position_ids.tolist(), mb.subtree_end.tolist()
    N = len(par)
    if any(not -1 <= par[p] < p for p in range(N)):
        return False

    def ancestors_or_self(q: int) -> list[int]:
        out = []
        while q >= 0:
            out.append(q)
            q = par[q]
        return out

    for p in range(N):
        if pos[p] != len(ancestors_or_self(p)) - 1:
            return False
    if any(e > N for e in end):  # the mask rule only looks at q < N, the contract bounds subtree_end too
        return False
    for q in range(N):
        anc = set(ancestors_or_self(q))
        for k in range(N):
            if (k <= q < end[k]) != (k in anc):
                return False
    off, sp = mb.seq_offsets.tolist(), mb.seq_positions.tolist()
    for i in range(len(off) - 1):
        for t in range(off[i + 1] - off[i]):
            k = off[i] + t
            if not 0 <= sp[k] < N or pos[sp[k]] != t or par[sp[k]] != (sp[k - 1] if t else -1):
                return False
            if t == 0 and mb.loss_mask[k] != 0:
                return False
    return True


class ReaderTest(unittest.TestCase):
    def setUp(self) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self.dir = self._dir.name
        self.count = 0

    def tearDown(self) -> None:
        self._dir.cleanup()

    def write(self, data: bytes) -> str:
        self.count += 1
        path = os.path.join(self.dir, f"f{self.count}.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_load_random_batches(self) -> None:
        rnd = random.Random(1)
        for _ in range(40):
            seqs = random_seqs(rnd)
            tensors, meta = micro_batch_tensors(seqs, rnd)
            mb = treepack.load(self.write(safetensors_bytes(tensors, meta)))
            by_name = {name: arr for name, _, arr in tensors}
            for name, arr in by_name.items():
                np.testing.assert_array_equal(getattr(mb, name), arr, err_msg=name)
                self.assertEqual(getattr(mb, name).dtype, arr.dtype)
            self.assertIsNone(mb.old_logprobs)
            self.assertEqual(mb.meta["num_sequences"], len(seqs))
            self.assertEqual(mb.meta["sequence_ids"], [f"id{i}" for i in range(len(seqs))])
            self.assertEqual(mb.meta["extra_key"], "kept")
            for i, s in enumerate(seqs):
                self.assertEqual(mb.sequence(i).tolist(), s)
            self.assertEqual(treepack.check_invariants(mb), [])
            self.assertTrue(brute_valid(mb))

    def test_views_extra_and_raw_dtypes(self) -> None:
        rnd = random.Random(2)
        tensors, meta = micro_batch_tensors([[1, 2], [1, 3]], rnd)
        bf16 = np.array([0x3F80, 0xC000], dtype="<u2")
        i64 = np.arange(6, dtype="<i8").reshape(2, 3)
        tensors += [("mask_bf16", "BF16", bf16), ("mask_i64", "I64", i64), ("empty", "F32", np.zeros((0, 2), "<f4"))]
        path = self.write(safetensors_bytes(tensors, meta))
        mb = treepack.load(path)
        np.testing.assert_array_equal(mb.extra["mask_bf16"], bf16)
        np.testing.assert_array_equal(mb.extra["mask_i64"], i64)
        self.assertEqual(mb.extra["empty"].shape, (0, 2))
        self.assertEqual(treepack.read_safetensors(path).dtypes["mask_bf16"], "BF16")
        self.assertFalse(mb.input_ids.flags.writeable)
        for i in (2, -1):
            with self.assertRaises(TreepackError) as caught:
                mb.sequence(i)
            self.assertEqual((caught.exception.code, caught.exception.field), ("E_INPUT", "seq_offsets"))
            self.assertIn(f"sequence {i} is out of range", str(caught.exception))

    def test_unaligned_tensor(self) -> None:
        data = safetensors_bytes([("a", "U8", np.array([9], "u1")), ("b", "I32", np.array([1, 2**31 - 1], "<i4"))])
        st = treepack.read_safetensors(self.write(data))
        self.assertEqual(st.tensors["b"].tolist(), [1, 2**31 - 1])

    def assert_input_error(self, path: str, field: str, fragment: str) -> None:
        with self.assertRaises(TreepackError) as cm:
            treepack.load(path)
        self.assertEqual(cm.exception.code, "E_INPUT")
        self.assertEqual(cm.exception.file, path)
        self.assertEqual(cm.exception.field, field)
        self.assertIn(fragment, str(cm.exception))

    def test_corrupt_files(self) -> None:
        rnd = random.Random(3)
        seqs = [[1, 2, 3], [1, 2, 4], [5]]
        tensors, meta = micro_batch_tensors(seqs, rnd)
        good = safetensors_bytes(tensors, meta)
        n = int.from_bytes(good[:8], "little")
        header = json.loads(good[8 : 8 + n])
        data = good[8 + n :]

        def rebuilt(mutate) -> str:  # type: ignore[no-untyped-def]
            h = json.loads(json.dumps(header))
            mutate(h)
            js = json.dumps(h).encode()
            return self.write(len(js).to_bytes(8, "little") + js + data)

        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        self.assert_input_error(self.write(good[:-2]), last, "truncated")
        # The format has no holes between tensors (the reference implementation refuses them).
        first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        gapped = safetensors_bytes(sorted(tensors, key=lambda t: header[t[0]]["data_offsets"][0]), meta, gap=4)
        self.assert_input_error(self.write(gapped), first, "invalid offset")
        self.assert_input_error(self.write(good[:5]), "__header__", "header too small")
        self.assert_input_error(self.write((len(good)).to_bytes(8, "little") + good[8:]), "__header__", "past the end of the file")
        self.assert_input_error(self.write((6).to_bytes(8, "little") + b'{"a":}'), "__header__", "invalid JSON in header")
        self.assert_input_error(rebuilt(lambda h: h["input_ids"].update(dtype="I33")), "input_ids", "unknown dtype")
        self.assert_input_error(rebuilt(lambda h: h["parent"].update(shape=[99])), "parent", "needs 396 bytes")

        def overlap(h) -> None:  # type: ignore[no-untyped-def]
            b, e = h["parent"]["data_offsets"]
            h["position_ids"]["data_offsets"] = [b + 4, e + 4]

        self.assert_input_error(rebuilt(overlap), "position_ids", "invalid offset")
        self.assert_input_error(
            self.write(safetensors_bytes([t for t in tensors if t[0] != "subtree_end"], meta)), "subtree_end", "missing"
        )
        self.assert_input_error(rebuilt(lambda h: h["loss_mask"].update(dtype="I8")), "loss_mask", "expected U8")
        self.assert_input_error(rebuilt(lambda h: h["__metadata__"].update(format="treepack/2")), "format", "treepack/2")
        self.assert_input_error(rebuilt(lambda h: h["__metadata__"].update(num_tokens_packed="9")), "num_tokens_packed", "tensors say 5")
        self.assert_input_error(rebuilt(lambda h: h["__metadata__"].update(num_sequences="x")), "num_sequences", "non-negative integer")
        self.assert_input_error(rebuilt(lambda h: h["__metadata__"].update(sequence_ids="[")), "sequence_ids", "not JSON")

        bad_offsets = [(k, d, np.array([0, 3, 6, 6], "<i4") if k == "seq_offsets" else a) for k, d, a in tensors]
        self.assert_input_error(self.write(safetensors_bytes(bad_offsets, meta)), "seq_offsets", "seq_offsets[S] = 6")
        with self.assertRaises(TreepackError) as cm:
            treepack.load(os.path.join(self.dir, "missing.safetensors"))
        self.assertEqual(cm.exception.code, "E_IO")

    def test_routes(self) -> None:
        """The routing-replay extension: routes I16 [N, layers, k] with routes_layers/routes_top_k; a node's row all -1
        (unrouted) or distinct experts >= 0 per layer."""
        seqs = [[1, 2, 3], [1, 2, 4], [5]]  # N = 5
        tensors, meta = micro_batch_tensors(seqs, random.Random(4))
        routes = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]], [[-1, -1], [-1, -1]], [[2, 1], [3, 0]]], "<i2")
        meta = dict(meta, routes_layers="2", routes_top_k="2")

        def with_routes(r: np.ndarray, dtype: str = "I16", **md: str) -> str:
            m = {k: v for k, v in dict(meta, **md).items() if v != ""}
            return self.write(safetensors_bytes([*tensors, ("routes", dtype, r)], m))

        mb = treepack.load(with_routes(routes))
        self.assertEqual(mb.routes.tolist(), routes.tolist())
        self.assertEqual((mb.meta["routes_layers"], mb.meta["routes_top_k"]), (2, 2))
        self.assertNotIn("routes", mb.extra)
        self.assertEqual(treepack.check_invariants(mb), [])
        self.assert_input_error(with_routes(routes.astype("<i4"), "I32"), "routes", "expected I16")
        self.assert_input_error(with_routes(routes.reshape(5, 4)), "routes", "expected [N, routes_layers, routes_top_k] = [5, 2, 2]")
        self.assert_input_error(with_routes(routes, routes_top_k="3"), "routes", "[5, 2, 3]")
        self.assert_input_error(with_routes(routes, routes_layers="0"), "routes_layers", "positive integer")
        self.assert_input_error(with_routes(routes, routes_layers=""), "routes", "[5, None, 2]")
        self.assert_input_error(self.write(safetensors_bytes(tensors, meta)), "routes", "go together")
        partial, twice = routes.copy(), routes.copy()
        partial[1, 0, 0] = -1
        twice[2, 1] = [1, 1]
        self.assertEqual(
            treepack.check_invariants(treepack.load(with_routes(partial))),
            ["routes negative at a routed node (-1 only for a node no occurrence was routed at) (1): routes[1] = [[-1, 2], [0, 3]]"],
        )
        self.assertEqual(
            treepack.check_invariants(treepack.load(with_routes(twice))),
            ["routes give a node one expert twice in a layer (1): routes[2] = [[3, 0], [1, 1]]"],
        )


class InvariantTest(unittest.TestCase):
    def batch(self, seqs: list[list[int]]) -> treepack.MicroBatch:
        f = {k: v.copy() for k, v in pack(seqs).items()}
        M = len(f["seq_positions"])
        meta = {"format": "treepack/1", "num_sequences": len(seqs), "num_tokens_naive": M}
        return treepack.MicroBatch(loss_mask=np.zeros(M, "u1"), meta=meta, **f)

    def test_each_violation(self) -> None:
        # Nodes: 0:1 (root) 1:2 2:3 3:4 4:5 5:6 (root); sequences occupy [0,1,2], [0,1,3], [0,4], [5].
        seqs = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
        self.assertEqual(self.batch(seqs).parent.tolist(), [-1, 0, 1, 1, 0, -1])
        self.assertEqual(treepack.check_invariants(self.batch(seqs)), [])
        cases = [
            ("parent", 2, 2, "parent[2] = 2"),
            ("parent", 0, -2, "parent[0] = -2"),
            ("position_ids", 3, 5, "position_ids[3] = 5, expected 2"),
            ("subtree_end", 1, 3, "subtree_end[1] = 3"),
            ("subtree_end", 5, 7, "subtree_end out of (p, N]"),
            ("seq_positions", 8, 6, "seq_positions[8] = 6 (sequence 3, t = 0)"),
            ("seq_positions", 2, 4, "parent[seq_positions[2]] = 0, expected 1 (sequence 0, t = 2)"),
            ("seq_offsets", 4, 8, "seq_offsets is not CSR"),
            ("loss_mask", 0, 1, "loss_mask[0] = 1 (sequence 0, t = 0)"),
        ]
        for field, index, value, fragment in cases:
            mb = self.batch(seqs)
            getattr(mb, field)[index] = value
            violations = treepack.check_invariants(mb)
            self.assertTrue(any(fragment in v for v in violations), f"{field}[{index}] = {value}: {violations}")

    def test_not_preorder(self) -> None:
        # Sequences [1, 2] and [3] with the root 3 between 1 and its child 2; subtree_end recomputed from parent.
        mb = treepack.MicroBatch(
            input_ids=np.array([1, 3, 2], "<i4"),
            position_ids=np.array([0, 0, 1], "<i4"),
            parent=np.array([-1, -1, 0], "<i4"),
            subtree_end=np.array([3, 2, 3], "<i4"),
            seq_offsets=np.array([0, 2, 3], "<i4"),
            seq_positions=np.array([0, 2, 1], "<i4"),
            loss_mask=np.zeros(3, "u1"),
            meta={},
        )
        violations = treepack.check_invariants(mb)
        self.assertEqual(len(violations), 1)
        self.assertIn("not a DFS preorder", violations[0])

    def test_pad_nodes(self) -> None:
        # num_pad_tokens: the last nodes are roots with no children that no occurrence reaches.
        mb = self.batch([[1, 2], [3]])
        mb.meta["num_pad_tokens"] = 1
        self.assertEqual(treepack.check_invariants(mb), ["seq_positions at a pad node (1): seq_positions[2] = 2 (sequence 1, t = 0)"])
        mb.meta["num_pad_tokens"] = 2
        self.assertIn("pad node not a root with no children (1): parent[1] = 0, subtree_end[1] = 2", treepack.check_invariants(mb))

    def test_core_refuses_bad_arguments(self) -> None:
        from treepack import _abi, _native

        counts = np.zeros(len(_abi.FOREST_CHECKS), dtype=np.int64)
        off = np.zeros(1, dtype=np.int32)
        check, off_p, counts_p = _native.core().tp_forest_check, _native.pointer(off), _native.pointer(counts)
        self.assertEqual(check(None, None, None, -1, 0, off_p, 0, None, None, None, 0, 0, counts_p, None), _abi.TP_ERR_ARG)
        self.assertEqual(check(None, None, None, 0, 0, off_p, 0, None, None, None, 0, 1, counts_p, None), _abi.TP_ERR_ARG)
        self.assertEqual(check(None, None, None, 0, 0, off_p, 0, None, None, None, 0, 0, counts_p, None), _abi.TP_OK)
        self.assertEqual(check(None, None, None, 2**31, 0, off_p, 0, None, None, None, 0, 0, counts_p, None), _abi.TP_ERR_ARG)

    def test_typed_pointers(self) -> None:
        # argtypes come from the headers (scripts/gen-abi.ts) with real pointer types: an int64 array given for an
        # int32_t* is refused by ctypes before the call, where a void* table would have let the core misread it.
        import ctypes

        from treepack import _native

        parent, out, roots = np.array([-1, 0], dtype=np.int64), np.zeros(3, dtype=np.int32), ctypes.c_int64(0)
        with self.assertRaises(ctypes.ArgumentError):
            _native.core().tp_mask_cu_seqlens(
                parent.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), 2, _native.pointer(out), 3, ctypes.byref(roots)
            )
        with self.assertRaises(ctypes.ArgumentError):
            _native.core().tp_mask_cu_seqlens(_native.pointer(parent), 2, _native.pointer(out), 3, ctypes.byref(roots))
        ok = _native.core().tp_mask_cu_seqlens(_native.pointer(parent.astype(np.int32)), 2, _native.pointer(out), 3, ctypes.byref(roots))
        self.assertEqual((ok, out.tolist(), roots.value), (0, [0, 2, 0], 1))

    def test_lengths(self) -> None:
        mb = self.batch([[1, 2]])
        mb.parent = mb.parent[:1]
        self.assertEqual(treepack.check_invariants(mb), ["parent has 1 elements: expected N = 2 (length of input_ids)"])
        mb = self.batch([[1, 2]])
        mb.advantages = np.zeros(3, "<f4")
        self.assertEqual(treepack.check_invariants(mb), ["advantages has 3 elements: expected M = 2 (length of seq_positions)"])

    def test_agrees_with_brute_force(self) -> None:
        rnd = random.Random(4)
        invalid = 0
        for _ in range(600):
            mb = self.batch(random_seqs(rnd, count=rnd.randint(1, 5), max_len=5))
            N = len(mb.input_ids)
            for _ in range(rnd.randint(1, 2)):
                arr = getattr(mb, rnd.choice(["parent", "position_ids", "subtree_end", "seq_positions", "loss_mask"]))
                if len(arr):
                    lo = 0 if arr.dtype == np.uint8 else -2
                    arr[rnd.randrange(len(arr))] = rnd.randint(lo, N + 1)
            valid = brute_valid(mb)
            invalid += not valid
            self.assertEqual(treepack.check_invariants(mb) == [], valid, mb)
        self.assertGreater(invalid, 200)

    def test_topological_layouts_agree_with_brute_force(self) -> None:
        """Nodes relabelled in random parent-first orders, subtree_end derived naively: only preorder can fail."""
        rnd = random.Random(6)
        not_preorder = 0
        for _ in range(400):
            mb = self.batch(random_seqs(rnd, count=rnd.randint(2, 6), max_len=5))
            N = len(mb.input_ids)
            children: dict[int, list[int]] = {p: [] for p in range(-1, N)}
            for p in range(N):
                children[int(mb.parent[p])].append(p)
            new = np.empty(N, dtype=np.int64)
            ready = list(children[-1])
            for label in range(N):
                p = ready.pop(rnd.randrange(len(ready)))
                new[p] = label
                ready += children[p]
            old = np.argsort(new)
            parent = np.where(mb.parent[old] < 0, -1, new[mb.parent[old]])
            end = np.arange(1, N + 1)
            for p in range(N - 1, -1, -1):
                if parent[p] >= 0:
                    end[parent[p]] = max(end[parent[p]], end[p])
            mb.input_ids, mb.position_ids = mb.input_ids[old], mb.position_ids[old]
            mb.parent, mb.subtree_end = parent.astype("<i4"), end.astype("<i4")
            mb.seq_positions = new[mb.seq_positions].astype("<i4")
            valid = brute_valid(mb)
            not_preorder += not valid
            self.assertEqual(treepack.check_invariants(mb) == [], valid, mb)
        self.assertGreater(not_preorder, 50)


class ValuesTest(unittest.TestCase):
    def write(self, d: str, name: str, change: dict[str, np.ndarray]) -> str:
        tensors, meta = micro_batch_tensors([[1, 2, 3], [1, 2], [4, 5]], random.Random(3))
        tensors = [(k, dt, change.get(k, a)) for k, dt, a in tensors]
        tensors.append(("old_logprobs", "F32", change.get("old_logprobs", np.full(7, -1.0, "<f4"))))
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(safetensors_bytes(tensors, meta))
        return path

    def test_values(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            good = treepack.load(self.write(d, "good.safetensors", {}))
            self.assertEqual(treepack.check_values(good, vocab_size=6), [])
            self.assertEqual(len(treepack.check_values(good, vocab_size=5)), 1)  # token 5 is out of a vocabulary of 5
            ids = good.input_ids.copy()
            ids[2] = -1
            bad = treepack.check_values(treepack.load(self.write(d, "ids.safetensors", {"input_ids": ids})))
            self.assertEqual(bad, ["input_ids negative (1): input_ids[2] = -1"])
            mask = np.array([0, 1, 7, 0, 1, 0, 1], "u1")
            self.assertEqual(
                treepack.check_values(treepack.load(self.write(d, "mask.safetensors", {"loss_mask": mask}))),
                ["loss_mask not 0 or 1 (1): loss_mask[2] = 7"],
            )
            # non-finite at a masked occurrence is fine, at a trainable one it is not
            mask = np.array([0, 1, 1, 0, 0, 0, 1], "u1")
            old = np.array([np.inf, -1, -np.inf, np.nan, np.nan, 0, -1], "<f4")
            path = self.write(d, "inf.safetensors", {"loss_mask": mask, "old_logprobs": old})
            self.assertEqual(
                treepack.check_values(treepack.load(path)),
                ["old_logprobs not finite at a trainable occurrence (1): old_logprobs[2] = -inf"],
            )
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(main(["check", path]), 1)
                self.assertEqual(main(["check", os.path.join(d, "good.safetensors"), "--vocab-size", "5"]), 1)
                self.assertEqual(main(["check", os.path.join(d, "good.safetensors"), "--vocab-size", "6"]), 0)
            self.assertIn("old_logprobs not finite", out.getvalue())


class CliTest(unittest.TestCase):
    def test_check(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            rnd = random.Random(5)
            tensors, meta = micro_batch_tensors([[1, 2, 3], [1, 2]], rnd)
            good = os.path.join(d, "good.safetensors")
            with open(good, "wb") as f:
                f.write(safetensors_bytes(tensors, meta))
            broken = [(k, dt, np.array([-1, 0, 0], "<i4") if k == "parent" else a) for k, dt, a in tensors]
            bad = os.path.join(d, "bad.safetensors")
            with open(bad, "wb") as f:
                f.write(safetensors_bytes(broken, meta))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(main(["check", good]), 0)
                self.assertEqual(main(["check", good, bad, os.path.join(d, "none")]), 1)
            lines = out.getvalue().splitlines()
            self.assertEqual(lines[0], f"{good}: OK (2 sequences, 5 naive -> 3 packed tokens)")
            self.assertTrue(any(line.startswith(f"{bad}: ") and "violation" in line for line in lines))
            self.assertTrue(any(line.startswith(f"{os.path.join(d, 'none')}: error [E_IO]") for line in lines))


class DirectoryTest(unittest.TestCase):
    """A packed directory as `treepack pack` lays it out: manifest.json naming files in a generation directory,
    beside files no reader may pick up (the previous generation, a run in progress)."""

    def setUp(self) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self.dir = self._dir.name
        rnd = random.Random(7)
        self.entries = []
        for gen, count in (("gen-000001", 3), ("gen-000002", 2)):
            os.makedirs(os.path.join(self.dir, gen))
            for i in range(count):
                seqs = random_seqs(rnd, count=3 + i)
                tensors, meta = micro_batch_tensors(seqs, rnd)
                name = f"{gen}/microbatch-{i:05d}.safetensors"
                with open(os.path.join(self.dir, name), "wb") as f:
                    f.write(safetensors_bytes(tensors, meta))
                if gen == "gen-000002":
                    self.entries.append(
                        {
                            "file": name,
                            "sequences": len(seqs),
                            "naive_tokens": int(meta["num_tokens_naive"]),
                            "packed_tokens": int(meta["num_tokens_packed"]),
                        }
                    )
        os.makedirs(os.path.join(self.dir, ".treepack-staging-gen-000003", "files"))
        self.write_manifest({"format": "treepack/1", "generation": 2, "micro_batches": self.entries})

    def tearDown(self) -> None:
        self._dir.cleanup()

    def write_manifest(self, doc: object) -> None:
        with open(os.path.join(self.dir, "manifest.json"), "w") as f:
            json.dump(doc, f)

    def test_lists_only_what_the_manifest_names(self) -> None:
        files = treepack.list_microbatches(self.dir)
        self.assertEqual(files, [os.path.join(self.dir, "gen-000002", f"microbatch-{i:05d}.safetensors") for i in range(2)])
        self.assertEqual(treepack.read_manifest(self.dir)["generation"], 2)
        for path, e in zip(files, self.entries):
            treepack.check_entry(treepack.load(path), e, path)

    def test_rejects_paths_outside_and_bad_entries(self) -> None:
        for bad in ("../x.safetensors", "/etc/passwd", "./gen-000002/a", "gen-000002//a", "", 3, "a\\b"):
            self.write_manifest({"format": "treepack/1", "micro_batches": [dict(self.entries[0], file=bad)]})
            with self.assertRaises(TreepackError) as cm:
                treepack.list_microbatches(self.dir)
            self.assertEqual((cm.exception.code, cm.exception.field), ("E_INPUT", "micro_batches[0].file"), bad)
        self.write_manifest({"format": "treepack/1", "micro_batches": [dict(self.entries[0], sequences=-1)]})
        with self.assertRaises(TreepackError) as cm:
            treepack.read_manifest(self.dir)
        self.assertEqual(cm.exception.field, "micro_batches[0].sequences")
        self.write_manifest({"format": "treepack/0", "micro_batches": []})
        with self.assertRaises(TreepackError) as cm:
            treepack.read_manifest(self.dir)
        self.assertEqual(cm.exception.field, "format")
        os.remove(os.path.join(self.dir, "manifest.json"))
        with self.assertRaises(TreepackError) as cm:
            treepack.read_manifest(self.dir)
        self.assertEqual(cm.exception.code, "E_IO")

    def test_check_directory(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["check", self.dir]), 0)
        self.assertEqual(len(out.getvalue().splitlines()), 2)
        self.assertIn("gen-000002", out.getvalue())
        # An entry naming a file of another run (other counts) fails the check.
        self.write_manifest(
            {"format": "treepack/1", "micro_batches": [dict(self.entries[0], file="gen-000001/microbatch-00002.safetensors")]}
        )
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["check", self.dir]), 1)
        self.assertIn("a file of another run", out.getvalue())


if __name__ == "__main__":
    unittest.main()
