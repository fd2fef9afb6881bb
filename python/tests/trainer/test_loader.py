"""The torch loader: file, bytes and MicroBatch give the same tensors in the documented dtypes; the dataset follows
the manifest (order, rank filter, DataLoader workers); bad files, shapes, dtypes, formats and forests give a
TreepackError naming the field."""

import json
import os
import tempfile
import unittest

import numpy as np
from support import forests, needs_torch, pack, torch, tpt, write_microbatch
from treepack import TreepackError, load


@needs_torch()
class Loader(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.mb = pack(forests(50, 1)["mixed"], pad=2, seed=1)
        self.path = os.path.join(self.dir, "mb.safetensors")
        write_microbatch(self.path, self.mb)

    def tearDown(self):
        self.tmp.cleanup()

    def test_path_bytes_and_microbatch_agree_with_the_file(self):
        with open(self.path, "rb") as f:
            raw = f.read()
        batches = [
            tpt.load_microbatch(self.path),
            tpt.load_microbatch(raw),
            tpt.load_microbatch(memoryview(raw)),
            tpt.load_microbatch(load(self.path)),
        ]
        for b in batches:
            for name in ("input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions"):
                t = getattr(b, name)
                self.assertEqual(t.dtype, torch.int64, name)
                self.assertTrue(np.array_equal(t.numpy(), getattr(self.mb, name)), name)
            self.assertEqual(b.loss_mask.dtype, torch.bool)
            self.assertTrue(np.array_equal(b.loss_mask.numpy(), self.mb.loss_mask != 0))
            for name in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
                self.assertEqual(getattr(b, name).dtype, torch.float32)
                self.assertTrue(np.array_equal(getattr(b, name).numpy(), getattr(self.mb, name)))
            self.assertEqual(b.num_pad_tokens, 2)
            self.assertEqual(b.meta["num_pad_tokens"], 2)
            # seq_index / token_index: occurrence j is token t of sequence i at seq_offsets[i] + t.
            for i in range(b.num_sequences):
                a, e = int(b.seq_offsets[i]), int(b.seq_offsets[i + 1])
                self.assertTrue(torch.equal(b.seq_index[a:e], torch.full((e - a,), i)))
                self.assertTrue(torch.equal(b.token_index[a:e], torch.arange(e - a)))
                self.assertTrue(torch.equal(b.sequence(i), torch.from_numpy(self.mb.sequence(i).astype(np.int64))))
            b.input_ids[0] = 1  # writable copies, not views on the mapped file
        self.assertEqual(b.to("cpu").num_nodes, self.mb.meta["num_tokens_packed"])

    def test_dataset_follows_the_manifest(self):
        files = []
        for i in range(5):
            name = f"gen-1/part-{i}.safetensors"  # any layout behind the manifest
            os.makedirs(os.path.join(self.dir, "gen-1"), exist_ok=True)
            mb = pack(forests(50, i)["wide"], seed=i)
            write_microbatch(os.path.join(self.dir, name), mb)
            counts = {
                "sequences": mb.meta["num_sequences"],
                "naive_tokens": mb.meta["num_tokens_naive"],
                "packed_tokens": mb.meta["num_tokens_packed"],
            }
            files.append({"file": name, "rank": i % 2, "step": i // 2, **counts})
        files.reverse()
        write_microbatch(os.path.join(self.dir, "stray.safetensors"), self.mb)  # not in the manifest: never read
        with open(os.path.join(self.dir, "manifest.json"), "w") as f:
            json.dump({"format": "treepack/1", "dp": 2, "micro_batches": files}, f)
        ds = tpt.PackedDataset(self.dir)
        self.assertEqual([os.path.basename(p) for p in ds.files()], [os.path.basename(e["file"]) for e in files])
        seen = [b.num_nodes for b in ds]
        self.assertEqual(len(seen), 5)
        self.assertEqual(
            [e["file"] for e in tpt.PackedDataset(self.dir, rank=1, dp=2).entries], [e["file"] for e in files if e["rank"] == 1]
        )
        with self.assertRaises(TreepackError) as cm:
            tpt.PackedDataset(self.dir, rank=0, dp=4)
        self.assertEqual(cm.exception.field, "dp")
        with self.assertRaises(TreepackError) as cm:
            tpt.PackedDataset(self.dir, rank=2, dp=2)
        self.assertEqual(cm.exception.field, "rank")
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        self.assertEqual(sorted(b.num_nodes for b in loader), sorted(seen))
        # A file swapped under the manifest (another run's) is refused, naming the count that disagrees.
        write_microbatch(os.path.join(self.dir, files[0]["file"]), self.mb)
        with self.assertRaises(TreepackError) as cm:
            list(tpt.PackedDataset(self.dir))
        self.assertIn(cm.exception.field, ("sequences", "naive_tokens", "packed_tokens"))
        os.remove(os.path.join(self.dir, "manifest.json"))
        with self.assertRaises(TreepackError) as cm:
            tpt.PackedDataset(self.dir)
        self.assertEqual(cm.exception.code, "E_IO")

    def test_bad_files_name_the_field(self):
        mb = self.mb
        cases = [
            ({"metadata": {"format": "treepack/2"}}, "format"),
            ({"metadata": {"num_pad_tokens": "x"}}, "num_pad_tokens"),
            ({"metadata": {"num_pad_tokens": str(len(mb.input_ids) + 1)}}, "num_pad_tokens"),
            ({"dtypes": {"seq_positions": np.int64}}, "seq_positions"),
            ({"dtypes": {"advantages": np.int32}}, "advantages"),
        ]
        for kw, field in cases:
            with self.subTest(field=field, kw=kw):
                p = os.path.join(self.dir, "bad.safetensors")
                write_microbatch(p, mb, **kw)
                with self.assertRaises(TreepackError) as cm:
                    tpt.load_microbatch(p)
                self.assertEqual(cm.exception.field, field, str(cm.exception))
        # Shapes that disagree with the contract and forests that break it are refused, never indexed.
        broken = {
            "parent": lambda m: m.parent.__setitem__(3, 7),
            "seq_positions": lambda m: m.seq_positions.__setitem__(2, -1),
            "subtree_end": lambda m: m.subtree_end.__setitem__(0, 1),
            "loss_mask": lambda m: m.loss_mask.__setitem__(0, 1),
        }
        for field, breaker in broken.items():
            with self.subTest(field=field):
                m = pack(forests(50, 1)["mixed"], seed=1)
                breaker(m)
                with self.assertRaises(TreepackError) as cm:
                    tpt.load_microbatch(m)
                self.assertEqual(cm.exception.field, field, str(cm.exception))
        m = pack(forests(50, 1)["mixed"], pad=2, seed=1)
        m.seq_positions[-1] = len(m.input_ids) - 1  # an occurrence mapped to a pad node
        with self.assertRaises(TreepackError):
            tpt.load_microbatch(m)
        with self.assertRaises(TreepackError) as cm:
            tpt.load_microbatch(b"\x01\x00")
        self.assertEqual(cm.exception.field, "__header__")

    def test_naive_batch_is_the_unshared_forest(self):
        from treepack import MicroBatch, check_invariants

        b = tpt.load_microbatch(self.path)
        n = tpt.naive_batch(b)
        self.assertEqual(n.num_nodes, b.num_occurrences)
        self.assertTrue(torch.equal(n.input_ids, b.input_ids[b.seq_positions]))
        as_np = MicroBatch(
            meta=n.meta,
            **{
                f: getattr(n, f).numpy().astype(np.int32)
                for f in ("input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions")
            },
            loss_mask=n.loss_mask.numpy().astype(np.uint8),
        )
        self.assertEqual(check_invariants(as_np), [])
        self.assertTrue(
            torch.equal(
                tpt.dense_tree_mask(n.subtree_end), tpt.dense_tree_mask(n.subtree_end) & (n.seq_index[:, None] == n.seq_index[None, :])
            )
        )
        for i in range(b.num_sequences):
            self.assertTrue(torch.equal(n.sequence(i), b.sequence(i)))

    @needs_torch(cuda="pinned memory and device copies need a CUDA device")
    def test_pinned_memory_to_cuda(self):
        b = tpt.load_microbatch(self.path, device="cuda", pin_memory=True)
        self.assertEqual(b.device.type, "cuda")
        self.assertTrue(tpt.load_microbatch(self.path).pin_memory().input_ids.is_pinned())


if __name__ == "__main__":
    unittest.main()
