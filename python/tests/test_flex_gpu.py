"""FlexAttention with the stored block mask equals SDPA with the dense tree mask (torch + CUDA; the GPU host).

Skipped where torch or a GPU is missing. Files come from TREEPACK_MASK_FILES (written by ``treepack pack --masks
block:128`` or test/python.test.ts); each is checked with random q, k, v in float32.
"""

from __future__ import annotations

import os
import unittest

import numpy as np
import treepack
from mask_reference import dense_mask
from treepack.flex import flex_block_mask

try:
    import torch

    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # torch is optional: the numpy reader must not need it
    HAVE_CUDA = False


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
@unittest.skipUnless(os.environ.get("TREEPACK_MASK_FILES"), "no micro-batch files with masks given (TREEPACK_MASK_FILES)")
class FlexEqualsSdpa(unittest.TestCase):
    def test_flex_attention_matches_sdpa(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention
        from torch.nn.functional import scaled_dot_product_attention

        gen = torch.Generator(device="cuda").manual_seed(0)
        for path in os.environ["TREEPACK_MASK_FILES"].split(os.pathsep):
            mb = treepack.load(path)
            n = len(mb.subtree_end)
            if n == 0:
                continue
            q, k, v = (torch.randn(1, 2, n, 64, device="cuda", generator=gen) for _ in range(3))
            block_mask = flex_block_mask(mb, device="cuda")
            got = flex_attention(q, k, v, block_mask=block_mask)
            dense = torch.as_tensor(dense_mask(np.asarray(mb.subtree_end)), device="cuda")
            want = scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None])
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=path)


if __name__ == "__main__":
    unittest.main()
