"""Vision-language models on packed trees (treepack.torch.vision): tiny random Qwen2.5-VL and Qwen3-VL in float64,
an agent episode whose calls resend screenshots, packed with ``treepack.pack_images``. Packed equals each sequence
run alone through the model's own forward (pixel values, ``get_rope_index`` positions, stock attention): logprobs,
the loss and every gradient, the vision tower's included, to 1e-10; negative controls differ; bad inputs name their
field."""

from __future__ import annotations

import copy
import importlib.util
import os
import unittest

import numpy as np
import treepack
from support import needs_torch, patch_norms_to_input_dtype, torch, tpt
from treepack import TreepackError
from treepack.microbatch import expected_grid, smart_resize

IMG, START, END, VIDEO = 120, 121, 122, 123
# The settings the header carries (CLIP's normalisation, Qwen2.5-VL's processor's).
PROC = {
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 64,
    "max_pixels": 1024,
    "image_token_id": IMG,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
TOL = 1e-10
# transformers' Qwen2-VL image processor without torchvision needs Pillow (python/requirements-torch.txt has it);
# python-torch.test.ts fails on a skipped suite, so CI cannot pass without it.
PIL_SKIP = "" if importlib.util.find_spec("PIL") else "Pillow not importable (pip install pillow): transformers' image processor needs it"


def needs_vision(cls):
    return unittest.skipIf(bool(PIL_SKIP), PIL_SKIP)(needs_torch(transformers=True)(cls))


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
        bos_token_id=None,
        eos_token_id=None,
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
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
    import json

    from treepack.torch.vision import _processor_from

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


@needs_vision
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
        split = torch.cat(
            [fills[:k], torch.tensor([[img, pos, first, half], [img, pos + half, first + half, count - half]]), fills[k + 1 :]]
        )
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


@needs_vision
class VisionLoss(unittest.TestCase):
    def test_packed_loss_equals_unpacked(self) -> None:
        """PackedLoss on a VL model's packed logprobs: the loss and every gradient equal the unpacked batch's."""
        calls, masks = episode()
        model = tiny_vl("qwen3_vl")
        model.set_attn_implementation("treepack")
        mb = treepack.pack_images(calls, screenshots(), PROC, loss_mask=masks, advantages=[0.5, -1.0, 2.0, 0.25, -0.75])
        mb.old_logprobs = (-np.random.default_rng(2).random(len(mb.seq_positions)) * 3).astype(np.float32)
        batch = tpt.from_microbatch(mb)
        loss_fn = tpt.PackedLoss({"clip_low": 0.2, "clip_high": 0.28})
        results = []
        for b in (batch, tpt.naive_batch(batch)):
            model.zero_grad()
            loss, _ = loss_fn(tpt.packed_logprobs(model, b).logprobs, b)
            loss.backward()
            results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (packed_loss, packed_grad), (naive_loss, naive_grad) = results
        self.assertLess(abs(packed_loss - naive_loss), TOL)
        self.assertGreater(float(packed_grad["model.visual.blocks.0.attn.qkv.weight"].abs().max()), 0)
        self.assertLess(grad_diff(packed_grad, naive_grad), TOL)


@needs_vision
class VisionInputs(unittest.TestCase):
    """Bad inputs name their field; a file round-trips; models that cannot run images are refused by name."""

    def setUp(self) -> None:
        self.calls, self.masks = episode()
        self.mb = packed(self.calls, self.masks)

    def problems(self, **changes) -> list[str]:
        for k, v in changes.items():
            setattr(self.mb, k, v)
        return treepack.check_invariants(self.mb)

    def refused_field(self, mb: treepack.MicroBatch) -> str:
        with self.assertRaises(TreepackError) as e:
            tpt.from_microbatch(mb)
        return e.exception.field

    def test_smart_resize_is_transformers(self) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

        for h, w in [(20, 28), (16, 16), (1, 9), (300, 7), (999, 1000), (33, 65), (8, 1500)]:
            for lo, hi in [(64, 1024), (56 * 56, 28 * 28 * 1280)]:
                self.assertEqual(smart_resize(h, w, 8, lo, hi), theirs(h, w, factor=8, min_pixels=lo, max_pixels=hi), (h, w, lo, hi))

    def test_file_round_trip(self) -> None:
        import os
        import tempfile

        from support import write_microbatch

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "mb.safetensors")
            write_microbatch(path, self.mb)
            back = treepack.load(path)
            batch = tpt.load_microbatch(path)
        for f in ("image_pixels", "image_sizes", "image_grid_thw", "image_fills", "mrope_position_ids"):
            self.assertTrue(np.array_equal(getattr(back, f), getattr(self.mb, f)), f)
        self.assertEqual(back.meta["image_processor"], PROC)
        self.assertEqual(back.meta["image_hashes"], self.mb.meta["image_hashes"])
        self.assertTrue(torch.equal(batch.image(1), torch.from_numpy(screenshots()["b"])))
        self.assertEqual(batch.mrope_position_ids.shape, (3, batch.num_nodes))

    def test_load_names_the_field(self) -> None:
        import os
        import tempfile

        from support import write_microbatch

        cases = [
            ({"image_fills": None}, {}, {}, "image_fills"),
            ({}, {}, {"image_sizes": np.int64}, "image_sizes"),
            ({"mrope_position_ids": np.zeros((2, 3), np.int32)}, {}, {}, "mrope_position_ids"),
            ({}, {"image_processor": "not json"}, {}, "image_processor"),
            ({}, {"image_processor": '{"patch_size": 4}'}, {}, "image_processor"),
        ]
        with tempfile.TemporaryDirectory() as d:
            for i, (fields, meta, dtypes, want) in enumerate(cases):
                mb = packed(self.calls, self.masks)
                for k, v in fields.items():
                    setattr(mb, k, v)
                path = os.path.join(d, f"{i}.safetensors")
                write_microbatch(path, mb, meta, dtypes)
                with self.assertRaises(TreepackError) as e:
                    treepack.load(path)
                self.assertEqual(e.exception.field, want, str(e.exception))

    def test_valid(self) -> None:
        self.assertEqual(treepack.check_invariants(self.mb), [])

    def test_placeholder_count_mismatch(self) -> None:
        # One more image_token_id than the fills cover (a text token that is a placeholder), and one fewer.
        ids = self.mb.input_ids.copy()
        text = int(np.flatnonzero(ids == 17)[0])
        ids[text] = IMG
        self.assertTrue(any("image_fills miss nodes of image_token_id" in p for p in self.problems(input_ids=ids)))
        self.assertEqual(self.refused_field(self.mb), "image_fills")
        self.mb = packed(self.calls, self.masks)
        fills = self.mb.image_fills.copy()
        fills[0, 3] += 1  # one node past the image's placeholders
        self.assertTrue(any(p.startswith("image_fills") for p in self.problems(image_fills=fills)), self.problems())
        self.assertEqual(self.refused_field(self.mb), "image_fills")

    def test_grid_mismatch(self) -> None:
        grid = self.mb.image_grid_thw.copy()
        grid[1] = [1, 8, 2]  # as many patches, another shape
        problems = self.problems(image_grid_thw=grid)
        self.assertTrue(problems and problems[0].startswith("image_grid_thw of image 1 (sha256:"), problems)
        self.assertEqual(self.refused_field(self.mb), "image_grid_thw")

    def test_mrope_rules(self) -> None:
        """3-D positions are checked node by node: a text node's, a placeholder's, and 1-D positions in their place."""
        for p in (int(np.flatnonzero(self.mb.input_ids == 17)[0]), int(np.flatnonzero(self.mb.input_ids == IMG)[5])):
            mb = packed(self.calls, self.masks)
            mrope = mb.mrope_position_ids.copy()
            mrope[2, p] += 1
            mb.mrope_position_ids = mrope
            problems = treepack.check_invariants(mb)
            self.assertTrue(
                problems and problems[0].startswith(f"mrope_position_ids not by the get_rope_index rules (1): mrope_position_ids[:, {p}]"),
                problems,
            )
            self.assertEqual(self.refused_field(mb), "mrope_position_ids")
        flat = np.repeat(self.mb.position_ids[None], 3, axis=0)
        self.assertTrue(any(p.startswith("mrope_position_ids not by") for p in self.problems(mrope_position_ids=flat)))

    def test_pixel_bytes(self) -> None:
        problems = self.problems(image_pixels=self.mb.image_pixels[:-3])
        self.assertTrue(problems and problems[0].startswith("image_pixels has"), problems)
        self.assertEqual(self.refused_field(self.mb), "image_pixels")

    def test_processor_mismatch_at_training(self) -> None:
        """The header's grid is valid, but the processor given makes another one: refused naming the image."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        model = tiny_vl("qwen2_5_vl")
        model.set_attn_implementation("treepack")
        other = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=256)
        with self.assertRaises(TreepackError) as e:
            tpt.packed_logprobs(model, tpt.from_microbatch(self.mb), image_processor=other)
        self.assertEqual(e.exception.field, "image_grid_thw")
        self.assertIn("image 0 (sha256:", str(e.exception))

    def test_processor_settings_not_guessed(self) -> None:
        """A header without the normalisation: the processor's defaults are one family's, so it is refused by name."""
        partial = {k: v for k, v in PROC.items() if k not in ("image_mean", "image_std")}
        batch = tpt.from_microbatch(treepack.pack_images(self.calls, screenshots(), partial, loss_mask=self.masks))
        model = tiny_vl("qwen2_5_vl")
        model.set_attn_implementation("treepack")
        with self.assertRaises(TreepackError) as e:
            tpt.packed_logprobs(model, batch)
        self.assertEqual(e.exception.field, "image_processor")
        self.assertIn("image_mean, image_std", str(e.exception))

    def test_models_refused_by_name(self) -> None:
        import transformers
        from support import tiny_model

        batch = tpt.from_microbatch(self.mb)
        with self.assertRaises(TreepackError) as e:
            tpt.packed_logprobs(tiny_model("qwen3", torch.float64, vocab=128), batch)
        self.assertEqual(e.exception.field, "image_fills")
        cfg = transformers.Qwen2VLConfig(
            text_config=dict(
                vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
            ),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=4),
        )
        other = transformers.Qwen2VLForConditionalGeneration(cfg)
        other.set_attn_implementation("treepack")
        with self.assertRaises(TreepackError) as e:
            tpt.packed_logprobs(other, batch)
        self.assertIn("Qwen2VLForConditionalGeneration (qwen2_vl)", str(e.exception))
        self.assertEqual(e.exception.field, "model")


@needs_vision
class VisionStepPlan(unittest.TestCase):
    def test_image_in_a_cached_prefix(self) -> None:
        """Micro-batches hanging from a cached prefix that holds a screenshot: the step plan's loss and every gradient
        (the vision tower's included) equal running each micro-batch in full; a prefix whose image differs is refused."""
        calls, masks = episode()
        model = tiny_vl("qwen3_vl")
        model.set_attn_implementation("treepack")
        h = 11  # [1, 2, 3, START, 7 of a's 8 placeholders]: the cut splits the image's fill
        plan = [
            ((1, 2), {"prefix_tokens": h, "prefix_push": [h], "prefix_release": 0}),  # pushes the image's prefix
            ((0, 3), {"prefix_tokens": h, "prefix_push": [], "prefix_release": 1}),  # reads it cached, then pops it
            ((4,), {"prefix_tokens": 0, "prefix_push": [], "prefix_release": 0}),
        ]  # text only
        batches = []
        for members, meta in plan:
            mb = treepack.pack_images([calls[i] for i in members], screenshots(), PROC, loss_mask=[masks[i] for i in members])
            mb.meta.update(meta)
            batches.append(tpt.from_microbatch(mb))
        self.assertEqual(batches[1].input_ids[:h].tolist(), [1, 2, 3, START] + [IMG] * 7)  # the cut falls inside the image
        weights = [
            torch.randn(b.num_occurrences, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i, b in enumerate(batches)
        ]

        def loss_fn(lp, b):
            w = weights[next(i for i, x in enumerate(batches) if x is b)]
            occ = tpt.gather_occurrences(lp, b)
            return (w[b.loss_mask] * occ[b.loss_mask]).sum() + 0.1 * (occ[b.loss_mask] ** 2).sum()

        result = tpt.run_step_plan(model, batches, loss_fn, attention="block", block_size=4)
        planned = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        full = [loss_fn(tpt.packed_logprobs(model, b).logprobs, b) for b in batches]
        sum(full).backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        self.assertLess(max(abs(float(a) - float(b.detach())) for a, b in zip(result.losses, full)), TOL)
        self.assertGreater(float(want["model.visual.blocks.0.attn.qkv.weight"].abs().max()), 0)
        self.assertLess(grad_diff(planned, want), TOL)
        self.assertEqual(result.pushed_tokens, h)
        # The same tokens, another screenshot in the prefix: not the cached one.
        flipped = screenshots()["a"][::-1].copy()
        other = dict(screenshots(), a=flipped, a_again=flipped)
        swapped = treepack.pack_images([calls[0], calls[3]], other, PROC, loss_mask=[masks[0], masks[3]])
        swapped.meta.update(plan[1][1])
        runner = tpt.StepPlanRunner(model, attention="block", block_size=4)
        runner.forward(batches[0])
        runner.release()
        with self.assertRaises(TreepackError) as e:
            runner.forward(tpt.from_microbatch(swapped))
        self.assertEqual(e.exception.field, "prefix_push")


@needs_vision
class VisionRefusals(unittest.TestCase):
    def test_forward_logprobs_refuses_by_name(self) -> None:
        from support import tiny_model

        calls, masks = episode()
        batch = tpt.from_microbatch(packed(calls, masks))
        model = tiny_vl("qwen2_5_vl")
        model.set_attn_implementation("treepack")
        with self.assertRaises(TreepackError) as e:
            tpt.forward_logprobs(model, batch)
        self.assertIn("Qwen2_5_VLForConditionalGeneration", str(e.exception))
        with self.assertRaises(TreepackError) as e:
            tpt.forward_logprobs(tiny_model("qwen3", torch.float64, vocab=128), batch)
        self.assertEqual(e.exception.field, "image_fills")

    def test_trl_integration_refuses_what_it_cannot_pack(self) -> None:
        if importlib.util.find_spec("trl") is None:
            self.skipTest("trl not importable")
        from support import tiny_model
        from treepack.integrations.trl import PackedForwardMixin

        ids = torch.tensor([[1, 2, IMG, 3]])
        images = dict(pixel_values=torch.zeros(4, 96), image_grid_thw=torch.tensor([[1, 2, 2]]), num_images=[1])
        trainer = fake_trainer(tiny_model("qwen3", torch.float64, vocab=128))
        with self.assertRaises(TreepackError) as e:
            PackedForwardMixin._get_per_token_logps_and_entropies(trainer, trainer.model, ids, torch.ones_like(ids), 1, **images)
        self.assertEqual(e.exception.field, "image_grid_thw")
        self.assertIn("Qwen3ForCausalLM is not a vision-language model", str(e.exception))
        trainer = fake_trainer(tiny_vl("qwen2_5_vl"))
        with self.assertRaises(TreepackError) as e:
            PackedForwardMixin._get_per_token_logps_and_entropies(
                trainer, trainer.model, ids, torch.ones_like(ids), 1, image_sizes=torch.tensor([[8, 8]]), **images
            )
        self.assertIn("image_sizes are not inputs of the Qwen2-VL family", str(e.exception))


def fake_trainer(model):
    """What TRL's ``_get_per_token_logps_and_entropies`` (stock, and the packed mixin's) read of its trainer: the
    mixin with the attributes a GRPOTrainer would hold."""
    import collections

    from treepack.integrations.trl import PackedForwardMixin

    class FakeTrainer(PackedForwardMixin):
        def __init__(self) -> None:
            self.model, self.temperature, self.num_generations, self.num_generations_eval = model, 1.0, 2, 2
            self.model_kwarg_keys = {"input_ids", "attention_mask", "logits_to_keep", "pixel_values", "image_grid_thw"}
            self._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
            self._entropy_bonus_enabled = True

    return FakeTrainer()


@needs_vision
class VisionTRL(unittest.TestCase):
    def test_rows_with_images_equal_stock_trl(self) -> None:
        for family in ("qwen2_5_vl", "qwen3_vl"):
            with self.subTest(family):
                self.check_family(family)

    def check_family(self, family: str) -> None:
        """TRL's rows with images (two groups of two: a screenshot shared by a group, two images in one prompt): the
        packed mixin's logprobs, entropies and every gradient equal stock TRL's padded forward; the forest shares
        each group's prompt and encodes each distinct image once."""
        if importlib.util.find_spec("trl") is None:
            self.skipTest("trl not importable")
        from treepack.integrations.trl import PackedForwardMixin
        from trl import GRPOTrainer

        imgs, proc = screenshots(), processor()
        prompts = [([1, 2, START, "a", END, 3], ["a"]), ([1, 2, START, "b", END, START, "c", END, 4], ["b", "c"])]
        completions = [[6, 7, 8], [9, 10], [11, 12, 13], [14]]
        rows, pv, grids, counts = [], [], [], []
        for k, completion in enumerate(completions):
            prompt, names = prompts[k // 2]
            ids = []
            for el in prompt:
                if isinstance(el, str):
                    out = proc(images=[imgs[el]], input_data_format="channels_last", return_tensors="pt")
                    pv.append(out["pixel_values"])
                    grids.append(out["image_grid_thw"])
                    ids += [IMG] * (int(out["image_grid_thw"].prod()) // 4)
                else:
                    ids.append(el)
            rows.append((ids, completion))
            counts.append(len(names))
        P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
        input_ids = torch.tensor([[0] * (P - len(p)) + p + c + [0] * (C - len(c)) for p, c in rows])
        attention = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c)) for p, c in rows])
        # As TRL's processor gives them (mm_token_type_ids: the model's 3-D positions need it; treepack recomputes it).
        images = dict(
            pixel_values=torch.cat(pv).double(),
            image_grid_thw=torch.cat(grids),
            num_images=counts,
            mm_token_type_ids=(input_ids == IMG).int(),
        )
        stock = tiny_vl(family)
        model = copy.deepcopy(stock)
        model.set_attn_implementation("treepack")
        encoded = []
        model.model.visual.register_forward_pre_hook(lambda m, a, kw: encoded.append(int(kw["grid_thw"].shape[0])), with_kwargs=True)
        w = torch.randn(len(rows), C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        completion_mask = attention[:, P:].bool()
        results = []
        for fn, m in (
            (GRPOTrainer._get_per_token_logps_and_entropies, stock),
            (PackedForwardMixin._get_per_token_logps_and_entropies, model),
        ):
            trainer = fake_trainer(m)
            logps, ent, _ = fn(trainer, m, input_ids, attention, C, compute_entropy=True, **images)
            ((w * logps)[completion_mask].sum() + ent[completion_mask].sum()).backward()
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            results.append((logps[completion_mask].detach(), ent[completion_mask].detach(), grads, trainer))
        (lp0, ent0, g0, _), (lp1, ent1, g1, packed_trainer) = results
        self.assertLess(float((lp0 - lp1).abs().max()), TOL)
        self.assertLess(float((ent0 - ent1).abs().max()), TOL)
        self.assertIn("model.visual.blocks.0.attn.qkv.weight", g1)
        self.assertLess(grad_diff(g0, g1), TOL)
        self.assertEqual(encoded, [3])  # a, b, c once each, in one call (stock encodes 6 images)
        tokens, nodes = packed_trainer.treepack_stats[-1]
        self.assertLess(nodes, tokens)

    def test_groups_split_with_their_images(self) -> None:
        """The grouping mixin splits a generation batch into micro-batches of whole groups: each keeps its rows'
        images (num_images, image_grid_thw and pixel_values rows, laid out per image, not per row)."""
        if importlib.util.find_spec("trl") is None:
            self.skipTest("trl not importable")
        import types

        from treepack.integrations.trl import GroupedBatchesMixin

        counts = [1, 1, 2, 2, 0, 0]  # groups of two: one image each; two each; none
        grid = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 4, 2], [1, 2, 2], [1, 4, 2], [1, 2, 2]])
        pixels = torch.arange(int(grid.prod(1).sum()), dtype=torch.float64)[:, None].repeat(1, 3)
        prompt = torch.tensor([[1, IMG, 2], [1, IMG, 2], [1, IMG, 3], [1, IMG, 3], [0, 4, 5], [0, 4, 5]])
        inputs = dict(
            prompt_ids=prompt,
            prompt_mask=(prompt != 0).long(),
            completion_ids=torch.tensor([[6], [7], [8], [9], [10], [11]]),
            completion_mask=torch.ones(6, 1, dtype=torch.long),
            advantages=torch.arange(6.0),
            pixel_values=pixels,
            image_grid_thw=grid,
            num_images=counts,
        )
        fake = types.SimpleNamespace(num_generations=2, treepack_max_tokens=None, args=types.SimpleNamespace(steps_per_generation=3))
        parts = GroupedBatchesMixin._treepack_split(fake, inputs)
        first = [sum(counts[:r]) for r in range(7)]
        starts = [0] + torch.cumsum(grid.prod(1), 0).tolist()
        seen = []
        for part in parts:
            rows = [int(a) for a in part["advantages"].tolist()]  # the advantages name the rows here
            seen += rows
            want = [i for r in rows for i in range(first[r], first[r + 1])]
            self.assertEqual(part["num_images"], [counts[r] for r in rows])
            self.assertTrue(torch.equal(part["image_grid_thw"], grid[want]))
            expect = torch.cat([pixels[starts[i] : starts[i + 1]] for i in want]) if want else pixels[:0]
            self.assertTrue(torch.equal(part["pixel_values"], expect))
        self.assertEqual(sorted(seen), list(range(6)))


@needs_vision
class VisionWriterFile(unittest.TestCase):
    """A micro-batch the TypeScript packer wrote (test/fixtures/images_microbatch.safetensors, see its README): it
    loads and checks, its 3-D positions are the model's own ``get_rope_index``, and a tiny Qwen2.5-VL of the file's
    processor settings and token ids gives each call's logprobs as its own forward does."""

    FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "test", "fixtures", "images_microbatch.safetensors")

    def test_packed_equals_each_call_alone(self) -> None:
        import transformers

        mb = treepack.load(self.FILE)
        self.assertEqual(treepack.check_invariants(mb), [])
        proc = mb.meta["image_processor"]
        batch = tpt.from_microbatch(mb)
        self.assertEqual((batch.num_images, batch.num_pad_tokens), (3, 24))
        text = dict(
            vocab_size=151936, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
        )
        text.update(
            max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        )
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=16, window_size=56, fullatt_block_indexes=[0]
        )
        vision.update(patch_size=proc["patch_size"], spatial_merge_size=proc["merge_size"], temporal_patch_size=proc["temporal_patch_size"])
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=proc["image_token_id"],
            video_token_id=151656,
            vision_start_token_id=proc["vision_start_token_id"],
            vision_end_token_id=proc["vision_end_token_id"],
        )
        torch.manual_seed(0)
        stock = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float64).eval()
        patch_norms_to_input_dtype(stock)
        model = copy.deepcopy(stock)
        model.set_attn_implementation("treepack")
        lp = tpt.gather_occurrences(tpt.packed_logprobs(model, batch).logprobs, batch).detach()
        nodes, images, placeholders = (t.tolist() for t in tpt.batch.filled_nodes(batch.image_fills))
        first_of = {n: i for n, i, j in zip(nodes, images, placeholders) if j == 0}  # the node where each image starts
        shown = 0
        for s in range(batch.num_sequences):
            a, b = int(batch.seq_offsets[s]), int(batch.seq_offsets[s + 1])
            pos = batch.seq_positions[a:b]
            ids = batch.input_ids[pos][None]
            seq_images = [first_of[p] for p in pos.tolist() if p in first_of]
            shown += len(seq_images)
            kw = {}
            if seq_images:
                kw = dict(
                    pixel_values=tpt.vision.pixel_values(batch, None, seq_images).double(),
                    image_grid_thw=batch.image_grid_thw[seq_images],
                    mm_token_type_ids=(ids == proc["image_token_id"]).int(),
                )
                rope, _ = stock.model.get_rope_index(ids, kw["mm_token_type_ids"], kw["image_grid_thw"])
                self.assertTrue(torch.equal(rope[:, 0], batch.mrope_position_ids[:, pos]), batch.meta["sequence_ids"][s])
            with torch.no_grad():
                ref = stock(input_ids=ids, **kw).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
            m = batch.loss_mask[a + 1 : b]
            self.assertLess(float((lp[a + 1 : b][m] - ref[m]).abs().max()), TOL, batch.meta["sequence_ids"][s])
        self.assertEqual(shown, 8)  # 8 images sent over 5 calls (e/1 resends A beside C), 3 distinct
