"""Vision-language models on packed trees (treepack.torch.vision): tiny random Qwen2.5-VL and Qwen3-VL in float64,
an agent episode whose calls resend screenshots, packed with ``treepack.pack_images``. Packed equals each sequence
run alone through the model's own forward (pixel values, ``get_rope_index`` positions, stock attention): logprobs,
the loss and every gradient, the vision tower's included, to 1e-10; negative controls differ; bad inputs name their
field."""

from __future__ import annotations

import copy
import unittest

import numpy as np
from support import needs_torch, patch_norms_to_input_dtype, torch, tpt

import treepack
from treepack import TreepackError
from treepack.microbatch import expected_grid, smart_resize

IMG, START, END, VIDEO = 120, 121, 122, 123
PROC = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 64, "max_pixels": 1024, "image_token_id": IMG}
TOL = 1e-10


def screenshots() -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    shots = {"a": (20, 28), "b": (16, 16), "c": (24, 20)}
    out = {k: r.integers(0, 256, (h, w, 3), dtype=np.uint8) for k, (h, w) in shots.items()}
    out["a_again"] = out["a"].copy()  # the same bytes under another name: one image
    return out


def episode() -> tuple[list[list], list[list[int]]]:
    """Calls of an agent: each resends the earlier screenshots; one branch shows an image the other does not; two
    images in one message; a text-only call in the same forest. (elements, loss mask per element)."""
    first = [1, 2, 3, START, "a", END, 4, 5]
    answer = [6, 7, 8]
    second = first + answer + [9, START, "b", END, START, "c", END, 10]
    third = first + answer + [9, START, "b", END, 13]
    fourth = [1, 2, 3, START, "a_again", END, 4, 5] + answer + [11]  # the same screenshot, renamed
    calls = [first + answer, second + [11, 12], third + [14, 15], fourth + [16], [1, 2, 3, 17, 18, 19]]
    prompt_lengths = [len(first), len(second), len(third), len(fourth), 3]
    masks = [[0] * n + [1] * (len(c) - n) for c, n in zip(calls, prompt_lengths)]
    return calls, masks


def tiny_vl(family: str, seed: int = 0):
    import transformers

    text = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        head_dim=8,
    )
    vision = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    ids = dict(image_token_id=IMG, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        vision.update(window_size=16, fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=None, eos_token_id=None, **ids)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "mrope_interleaved": True}
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
        cls = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64).eval()
    patch_norms_to_input_dtype(model)
    return model


def processor():
    from treepack.torch.vision import _processor_from

    import json

    return _processor_from(json.dumps(PROC, sort_keys=True))


def reference(model, calls: list[list], masks: list[list[int]], weights: list[torch.Tensor]):
    """Each call alone through the model's own forward (stock attention, its own 3-D positions from
    ``get_rope_index``): per-token logprobs of the trained tokens, and the weighted sum (the loss) backward."""
    imgs = screenshots()
    proc = processor()
    logps, loss = [], 0.0
    for call, mask, w in zip(calls, masks, weights):
        ids, grids, pv = [], [], []
        for el in call:
            if isinstance(el, str):
                out = proc(images=[imgs[el]], input_data_format="channels_last", return_tensors="pt")
                grids.append(out["image_grid_thw"])
                pv.append(out["pixel_values"])
                ids += [IMG] * (int(out["image_grid_thw"].prod()) // 4)
            else:
                ids.append(el)
        tok = torch.tensor([ids])
        kw = {}
        if grids:
            kw = dict(pixel_values=torch.cat(pv).double(), image_grid_thw=torch.cat(grids), mm_token_type_ids=(tok == IMG).int())
        logits = model(input_ids=tok, **kw).logits[0]
        lp = logits[:-1].log_softmax(-1).gather(1, tok[0, 1:, None])[:, 0]
        trained = torch.tensor(expand_mask(call, mask, imgs)[1:], dtype=torch.bool)
        logps.append(lp[trained])
        loss = loss + (w * lp[trained]).sum()
    loss.backward()
    return logps, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def expand_mask(call: list, mask: list[int], imgs: dict[str, np.ndarray]) -> list[int]:
    out = []
    for el, m in zip(call, mask):
        if isinstance(el, str):
            g = expected_grid(PROC, *imgs[el].shape[:2])
            out += [0] * (g[0] * g[1] * g[2] // 4)
        else:
            out.append(m)
    return out


def rope_reference(model, calls: list[list]) -> list[torch.Tensor]:
    """[3, L] per call: the model's own get_rope_index."""
    imgs = screenshots()
    out = []
    for call in calls:
        ids, grids = [], []
        for el in call:
            if isinstance(el, str):
                g = expected_grid(PROC, *imgs[el].shape[:2])
                grids.append(g)
                ids += [IMG] * (g[0] * g[1] * g[2] // 4)
            else:
                ids.append(el)
        tok = torch.tensor([ids])
        pos, _ = model.model.get_rope_index(tok, (tok == IMG).int(), torch.tensor(grids) if grids else None)
        out.append(pos[:, 0])
    return out


def packed(calls, masks) -> treepack.MicroBatch:
    return treepack.pack_images(calls, screenshots(), PROC, loss_mask=masks)


def packed_run(model, batch, weights: list[torch.Tensor], **kw):
    model.zero_grad()
    lp = tpt.packed_logprobs(model, batch, **kw).logprobs
    occ = tpt.gather_occurrences(lp, batch)
    per_seq, loss = [], 0.0
    for s, w in enumerate(weights):
        a, b = int(batch.seq_offsets[s]), int(batch.seq_offsets[s + 1])
        x = occ[a:b][batch.loss_mask[a:b]]
        per_seq.append(x)
        loss = loss + (w * x).sum()
    loss.backward()
    return per_seq, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b))


def grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@needs_torch(transformers=True)
class VisionExactness(unittest.TestCase):
    def run_family(self, family: str) -> None:
        calls, masks = episode()
        stock = tiny_vl(family)
        model = copy.deepcopy(stock)
        model.set_attn_implementation("treepack")
        mb = packed(calls, masks)
        self.assertEqual(treepack.check_invariants(mb), [])
        batch = tpt.from_microbatch(mb)
        self.assertEqual(batch.num_images, 3)  # a, b, c: "a_again" is a's bytes
        # The 3-D positions scattered to nodes equal the model's own per call, at every occurrence.
        for s, pos in enumerate(rope_reference(stock, calls)):
            a, b = int(batch.seq_offsets[s]), int(batch.seq_offsets[s + 1])
            self.assertTrue(torch.equal(batch.mrope_position_ids[:, batch.seq_positions[a:b]], pos), f"call {s}")
        r = torch.Generator().manual_seed(1)
        weights = [torch.randn(sum(m), generator=r, dtype=torch.float64) for m in masks]
        want_lp, want_grad = reference(stock, calls, masks, weights)
        self.assertIn("model.visual.blocks.0.attn.qkv.weight", want_grad)
        got_lp, got_grad = packed_run(model, batch, weights)
        self.assertLess(max_diff(got_lp, want_lp), TOL)
        self.assertLess(grad_diff(got_grad, want_grad), TOL)
        # Unpacked through the same path (naive_batch: every call its own copy of each image it shows).
        naive = tpt.naive_batch(batch)
        self.assertEqual(naive.num_images, 7)  # a; a, b, c; a, b; a (renamed); none
        n_lp, n_grad = packed_run(model, naive, weights)
        self.assertLess(max_diff(n_lp, want_lp), TOL)
        self.assertLess(grad_diff(n_grad, want_grad), TOL)
        # A fill split in two (a micro-batch cut through an image) takes the right slices.
        fills = batch.image_fills
        k = int(torch.argmax(fills[:, 3]))
        img, pos, first, count = fills[k].tolist()
        half = count // 2
        split = torch.cat([fills[:k], torch.tensor([[img, pos, first, half], [img, pos + half, first + half, count - half]]), fills[k + 1 :]])
        s_lp, s_grad = packed_run(model, tpt.PackedBatch(**{**batch.__dict__, "image_fills": split}), weights)
        self.assertLess(max_diff(s_lp, want_lp), TOL)
        self.assertLess(grad_diff(s_grad, want_grad), TOL)
        # Negative controls: 1-D positions; the encoder's output scattered at another image's rows.
        flat = tpt.PackedBatch(**{**batch.__dict__, "mrope_position_ids": batch.position_ids.expand(3, -1).clone()})
        self.assertGreater(max_diff(packed_run(model, flat, weights)[0], want_lp), 1e-4)
        wrong = split.clone()
        wrong[k + 1, 2] = first  # the cut's second part given the first part's slice
        bad = tpt.PackedBatch(**{**batch.__dict__, "image_fills": wrong})
        self.assertGreater(max_diff(packed_run(model, bad, weights)[0], want_lp), 1e-4)

    def test_qwen2_5_vl(self) -> None:
        self.run_family("qwen2_5_vl")

    def test_qwen3_vl(self) -> None:
        self.run_family("qwen3_vl")
