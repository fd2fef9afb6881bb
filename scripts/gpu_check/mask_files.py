"""Writes micro-batch files with their block mask (what ``treepack pack --masks block:128,slices`` stores), in Python, for
python/tests/test_flex_gpu.py on a host without node: the forests of cuda_vs_core.py (adversarial and random), each
packed by the C core, its lowerings the C core's. Prints the paths joined by os.pathsep (TREEPACK_MASK_FILES).

    TREEPACK_MASK_FILES=$(python scripts/gpu_check/mask_files.py DIR)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treepack  # noqa: E402  (cuda_vs_core put python/ on sys.path)
from cuda_vs_core import forests  # noqa: E402
from treepack.flex import BLOCK_TENSORS, block_arrays_from_tree, slices_from_tree  # noqa: E402

BLOCK = 128


def write(directory: str) -> list:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, (name, seqs) in enumerate(forests(large=False).items()):
        if not seqs:
            continue  # N = 0: nothing to attend
        mb = treepack.pack_sequences(seqs)
        n = len(mb.input_ids)
        arrays = block_arrays_from_tree(mb.subtree_end, BLOCK)
        nb = -(-n // BLOCK)
        index = ("input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions")
        tensors = {k: np.ascontiguousarray(getattr(mb, k), dtype=np.int32) for k in index}
        tensors["loss_mask"] = np.ascontiguousarray(mb.loss_mask, dtype=np.uint8)
        for key, a in zip(BLOCK_TENSORS, arrays[1:]):
            tensors[key] = np.ascontiguousarray(a, dtype=np.int32).reshape((nb,) if a.ndim == 1 else (nb, nb))
        tensors["slices"] = np.ascontiguousarray(slices_from_tree(mb.parent, mb.subtree_end))
        meta = {
            "format": treepack.FORMAT,
            "num_sequences": str(len(seqs)),
            "num_tokens_naive": str(len(mb.seq_positions)),
            "num_tokens_packed": str(n),
            "tokenizer": "none",
            "sequence_ids": json.dumps([str(j) for j in range(len(seqs))]),
            "block_size": str(BLOCK),
            "forest": name,
        }
        path = os.path.join(directory, f"microbatch-{i:05d}.safetensors")
        save_file(tensors, path, metadata=meta)
        paths.append(path)
    return paths


if __name__ == "__main__":
    print(os.pathsep.join(write(sys.argv[1])))
