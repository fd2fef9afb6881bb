"""The tree's block lists built with torch ops on the tensor's own device (``treepack.torch.blocks.block_arrays``, what
``tree_mask`` and ``windowed`` build from) against the oracles: the C core's ``tp_mask_blocks``
(``flex.block_arrays_from_tree``) and ``flex.block_arrays_windowed`` for query rows from 0 and, at a block-aligned first
row, their rows from there; at any first row, the tiles torch derives from the brute-force dense rule
(``mask_reference``). Forests: random ones, and empty, one token, ragged last blocks, duplicates, a sequence that is a
prefix of another, depth >= 30, very wide, positions that are not depths, and one of >= 128k tokens; block sizes 1,
3, 4, 16, 128; several windows. A negative control: the tile rule of block bounds alone (least and greatest position
per block) differs from the oracle on these forests, and the comparison says so.

No device synchronisation: the lists and the TreeMask build on the meta device, which has no values (every read of
one, ``.item()``, ``.cpu()``, ``nonzero``, ``bool()``, raises: checked here too), and on CUDA under
``torch.cuda.set_sync_debug_mode("error")`` (a GPU host only)."""

import random
import unittest

import numpy as np
from support import forests, needs_torch, pack, torch, tpt

# isort: split
# support (above) puts python/tests on sys.path, where mask_reference lives
from mask_reference import block_arrays_from_dense, dense_mask, random_forest
from treepack import TreepackError
from treepack.flex import block_arrays_from_tree, block_arrays_windowed
from treepack.pack import pack_sequences

if torch is not None:
    from treepack.torch.blocks import block_arrays

DEVICES = ("cpu",) + (("cuda",) if torch is not None and torch.cuda.is_available() else ())
NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
WINDOWS = (None, 1, 2, 5, 17, 1000)


def depths(par, rng=None):
    """position_ids = depth, plus a random offset per root when ``rng`` is given (the packer's convention)."""
    pos = np.zeros(len(par), dtype=np.int64)
    for p in range(len(par)):
        pos[p] = (int(rng.integers(0, 5)) if rng is not None else 0) if par[p] < 0 else pos[par[p]] + 1
    return pos


def first_rows(n, B):
    """q_start values: 0, mid-block, block-aligned, N."""
    return sorted({q for q in (0, 1, B // 2 + B, B, 2 * B, n) if q <= n})


def oracle(se, pos, W, B, q_start=0):
    """The C core's (or block_arrays_windowed's) rows from a block-aligned q_start; else the dense rule's tiles."""
    if q_start % B == 0:
        whole = block_arrays_from_tree(se, B) if W is None else block_arrays_windowed(se, pos, W, B)
        return tuple(a[q_start // B :] for a in whole[1:])
    return block_arrays_from_dense(dense_mask(se, pos, W, q_start), B)[1:]


def packed(seqs, pad=0):
    mb = pack(seqs, pad=pad, floats=False)
    return mb.subtree_end.astype(np.int64), mb.position_ids.astype(np.int64)


def adversarial():
    """(name, subtree_end, position_ids) of the shapes a tile rule gets wrong first."""
    r = random.Random(7)
    tok = lambda n: [r.randrange(1, 500) for _ in range(n)]  # noqa: E731
    out = [("empty", np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)), ("one token", np.array([1]), np.array([0]))]
    for n in (17, 33, 129):  # ragged last blocks of every block size tested
        out.append((f"chain of {n}", np.full(n, n), np.arange(n)))
    for name, seqs in forests(50, seed=3).items():  # deep, wide, duplicates, prefix, mixed
        out.append((name, *packed(seqs, pad=2)))
    stem = tok(40)
    out.append(("depth 43", *packed([stem[:d] + tok(3) for d in range(0, 41, 4)])))
    out.append(("600 leaves on a root", *packed([[1, t] for t in range(2, 602)])))
    out.append(("identical sequences", *packed([stem[:9]] * 4 + [stem[:9] + tok(2)])))
    se, pos = packed([stem[:30] + tok(5), stem[:12] + tok(20), tok(3)])
    out.append(("positions that are not depths", se, np.random.default_rng(1).integers(-40, 40, len(se))))
    return out


def large_forest():
    """>= 128k tokens: sequences that share random prefixes of earlier ones, packed by the C core."""
    rng = np.random.default_rng(5)
    seqs, total = [], 0
    while total < 300_000:
        base = seqs[int(rng.integers(len(seqs)))] if seqs and rng.random() < 0.8 else []
        seqs.append(base[: int(rng.integers(0, len(base) + 1))] + rng.integers(1, 50_000, int(rng.integers(20, 400))).tolist())
        total += len(seqs[-1])
    mb = pack_sequences(seqs)
    return mb.subtree_end.astype(np.int64), mb.position_ids.astype(np.int64)


def bounds_only(se, pos, W, B):
    """A deliberately wrong windowed tile rule: the tree's tiles classified by block bounds alone (a tile is kept when
    its least query position minus its greatest key position is inside the window), blind to whether the pairs inside
    the window are the tree's. The negative control."""
    tree = block_arrays_from_tree(se, B)
    nb = len(tree.kv_num_blocks)
    pos_pad = np.concatenate([pos, np.full(nb * B - len(se), pos[-1])]).reshape(nb, B)
    lo, hi = pos_pad.min(1), pos_pad.max(1)
    grid = np.zeros((nb, nb), dtype=np.int8)  # 1 partial, 2 full
    for num, idx, kind in ((tree.kv_num_blocks, tree.kv_indices, 1), (tree.full_kv_num_blocks, tree.full_kv_indices, 2)):
        for i in range(nb):
            for j in idx[i, : num[i]]:
                if lo[i] - hi[j] < W:
                    grid[i, j] = 2 if kind == 2 and hi[i] - lo[j] < W else 1
    # As tiles of B = 1, a grid is its own dense mask: its listed cells come back as the "full" lists.
    part, full = block_arrays_from_dense(grid == 1, 1), block_arrays_from_dense(grid == 2, 1)
    return part.full_kv_num_blocks, part.full_kv_indices, full.full_kv_num_blocks, full.full_kv_indices


@needs_torch()
class DeviceBlockArrays(unittest.TestCase):
    def assert_arrays(self, got, want, what):
        for name, g, w in zip(NAMES, got, want):
            g = g.cpu().numpy()
            if g.dtype != np.int32 or not np.array_equal(g, w):
                self.fail(f"{what}: {name}\n got {g.dtype} {g.tolist()}\nwant {np.asarray(w).tolist()}")

    def check(self, se, pos, blocks, windows, what, dense=True):
        for dev in DEVICES:
            se_t, pos_t = torch.as_tensor(se, device=dev), torch.as_tensor(pos, device=dev)
            for B in blocks:
                for W in windows:
                    for q in first_rows(len(se), B):
                        got = block_arrays(se_t, B, None if W is None else pos_t, W, q_start=q)
                        for g in got:
                            self.assertEqual(g.device.type, dev)
                        if q % B == 0:
                            self.assert_arrays(got, oracle(se, pos, W, B, q), f"{what}, {dev}, B = {B}, W = {W}, q_start = {q}: C core")
                        if dense and len(se) < 1000:
                            want = block_arrays_from_dense(dense_mask(se, pos, W, q), B)[1:]
                            self.assert_arrays(got, want, f"{what}, {dev}, B = {B}, W = {W}, q_start = {q}: dense rule")

    def test_random_forests(self):
        rng = np.random.default_rng(11)
        for trial in range(25):
            par, se = random_forest(rng)
            pos = depths(par, rng) if trial % 5 else rng.integers(0, 12, len(se))  # every 5th: positions not depths
            self.check(se, pos, (1, 3, 4, 16), (None, 1, 2, 5, 1000), f"random forest {trial} (N = {len(se)})")

    def test_adversarial_forests(self):
        for name, se, pos in adversarial():
            self.check(se, pos, (1, 4, 16, 128), WINDOWS, f"{name} (N = {len(se)})")

    def test_128k_tokens(self):
        se, pos = large_forest()
        n = len(se)
        self.assertGreaterEqual(n, 128 * 1024)
        B = 128
        aligned = B * (n // B // 2)
        for dev in DEVICES:
            se_t, pos_t = torch.as_tensor(se, device=dev), torch.as_tensor(pos, device=dev)
            for W in (None, 1000):
                whole = oracle(se, pos, W, B)
                for q in (0, aligned):
                    got = block_arrays(se_t, B, None if W is None else pos_t, W, q_start=q)
                    self.assert_arrays(got, [a[q // B :] for a in whole], f"N = {n}, {dev}, W = {W}, q_start = {q}")
            # A first row inside a block: its first two query blocks against the dense rule's rows (keys past
            # their last row are seen by none of them, so the keys before it suffice).
            mid, end = aligned + B // 2, aligned + B // 2 + 2 * B
            got = block_arrays(se_t, B, q_start=mid)
            self.assertEqual(tuple(got[1].shape), (-(-(n - mid) // B), -(-n // B)))
            want = block_arrays_from_dense(dense_mask(se[:end], q_start=mid), B)[1:]
            nkv = want[1].shape[1]
            for name, g, w in zip(NAMES, got, want):
                g = g[:2].cpu().numpy()
                self.assertTrue(np.array_equal(g[..., :nkv], w) and not g[..., nkv:].any(), f"N = {n}, {dev}, q_start = {mid}: {name}")

    def test_windowed_negative_control(self):
        # The exact windowed lists drop tiles whose in-window pairs are not the tree's; the block-bounds rule keeps
        # them. These forests have such tiles, and the comparison the suite makes tells the two apart.
        caught = 0
        for name, se, pos in adversarial():
            for B in (4, 16):
                for W in (2, 5, 17):
                    if len(se) == 0:
                        continue
                    wrong = bounds_only(se, pos, W, B)
                    want = oracle(se, pos, W, B)
                    got = block_arrays(torch.as_tensor(se), B, torch.as_tensor(pos), W)
                    self.assert_arrays(got, want, f"{name}, B = {B}, W = {W}")
                    if any(not np.array_equal(a, b) for a, b in zip(wrong, want)):
                        caught += 1
                        with self.assertRaises(AssertionError):
                            self.assert_arrays(got, wrong, "the bounds-only rule")
        self.assertGreater(caught, 0)

    def test_errors_name_the_field(self):
        se = torch.tensor([3, 3, 3])
        cases = [
            ("block_size", lambda: block_arrays(se, 0)),
            ("block_size", lambda: block_arrays(se, True)),
            ("q_start", lambda: block_arrays(se, 2, q_start=-1)),
            ("q_start", lambda: block_arrays(se, 2, q_start=4)),
            ("position_ids", lambda: block_arrays(se, 2, window=3)),
            ("position_ids", lambda: block_arrays(se, 2, torch.tensor([0, 1]), 3)),
            ("sliding_window", lambda: block_arrays(se, 2, torch.tensor([0, 1, 2]), 0)),
            ("subtree_end", lambda: block_arrays(torch.tensor([3, 1, 3]), 2)),
            ("subtree_end", lambda: block_arrays(torch.tensor([4, 3, 3]), 2)),
            # A host tree is checked before the upload, whatever the target device.
            ("subtree_end", lambda: tpt.tree_mask(torch.tensor([1, 1]), device="meta")),
        ]
        for field, call in cases:
            with self.subTest(field=field):
                with self.assertRaises(TreepackError) as cm:
                    call()
                self.assertEqual(cm.exception.field, field, str(cm.exception))


@needs_torch()
class NoDeviceSync(unittest.TestCase):
    def test_the_meta_device_refuses_every_read_of_a_value(self):
        # The probe's own control: each way a builder could read a value to the host raises on meta.
        x = torch.tensor([3, 1, 3], device="meta")
        for read in (
            lambda: x[0].item(),
            lambda: x.cpu(),
            lambda: x.tolist(),
            lambda: torch.nonzero(x),
            lambda: x[x > 1],
            lambda: bool(x.any()),
        ):
            with self.assertRaises((RuntimeError, NotImplementedError)):
                read()

    def test_lists_and_tree_mask_build_on_the_meta_device(self):
        for name, se, pos in adversarial()[:8]:
            se_m, pos_m = torch.as_tensor(se, device="meta"), torch.as_tensor(pos, device="meta")
            n = len(se)
            for B in (1, 4):
                for W in (None, 3):
                    for q in first_rows(n, B):
                        with self.subTest(forest=name, block_size=B, window=W, q_start=q):
                            got = block_arrays(se_m, B, None if W is None else pos_m, W, q_start=q)
                            nq, nkv = -(-(n - q) // B), -(-n // B)
                            self.assertEqual([tuple(g.shape) for g in got], [(nq,), (nq, nkv), (nq,), (nq, nkv)])
                            self.assertTrue(all(g.device.type == "meta" for g in got))
            mask = tpt.windowed(tpt.tree_mask(se_m, mode="flex", block_size=4, position_ids=pos_m), 3)
            self.assertEqual(mask.kv_indices.device.type, "meta")
            self.assertEqual(mask.full_q_indices.device.type, "meta")

    @needs_torch(cuda="no CUDA device: the synchronisation check runs on a GPU host")
    def test_no_synchronisation_on_cuda(self):
        se, pos = packed(forests(50, seed=3)["mixed"], pad=3)
        se_c, pos_c = torch.as_tensor(se, device="cuda"), torch.as_tensor(pos, device="cuda")
        cases = [(W, q) for W in (None, 3) for q in (0, 5)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            arrays = [block_arrays(se_c, 4, None if W is None else pos_c, W, q_start=q) for W, q in cases]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for (W, q), got in zip(cases, arrays):
            same = all(np.array_equal(g.cpu().numpy(), w) for g, w in zip(got, oracle(se, pos, W, 4, q)))
            self.assertTrue(same, f"W = {W}, q_start = {q}")
        torch.cuda.set_sync_debug_mode("error")
        try:
            mask = tpt.windowed(tpt.tree_mask(se_c, mode="flex", block_size=128, position_ids=pos_c), 3)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        self.assertEqual(mask.kv_indices.device.type, "cuda")


if __name__ == "__main__":
    unittest.main()
