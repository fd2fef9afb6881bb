"""A GUI agent's episode on a packed tree: every call resends the earlier screenshots, packed once, encoded once.

    python examples/multimodal_tree.py

1. a tiny random-weight Qwen2.5-VL (transformers' class), built here in float64;
2. an episode of an agent that looks at a screen (screenshots drawn here with numpy), acts, and looks again: call k
   resends the whole history, the k screenshots seen so far, and its last call is sampled twice (two actions);
3. ``treepack.pack_images`` packs the calls: each screenshot is its pixels' hash, so the calls that resend it share
   its placeholder nodes, and the 3-D rotary positions (temporal, height, width) come per node;
4. one training step packed (``packed_logprobs``: the vision encoder runs once per distinct screenshot, its
   embeddings scattered into the tree; ``packed_loss``; SGD) and the same step unpacked: each call alone through the
   model's own forward (its processor's pixel values, its own ``get_rope_index`` positions, stock attention), which
   encodes every screenshot once per call that shows it.

It prints the token compression and the vision encoder's work both ways; the last line is JSON with the largest
differences between the two runs of the per-token logprobs, the loss and every parameter's gradient (the vision
tower's included), float64 rounding (about 1e-13).

Needs torch, transformers and Pillow (``node scripts/python-env.mjs`` makes a .venv with them) and the C core
(``npm install`` builds it).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The installed package (`pip install ./python`) when there is one, else this checkout's sources.
if importlib.util.find_spec("treepack") is None:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import treepack  # noqa: E402
import treepack.torch as tpt  # noqa: E402  (registers attn_implementation "treepack")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

IMAGE, START, END, VIDEO = 120, 121, 122, 123
# The engine's image processor settings (the header's image_processor): 4-pixel patches merged 2x2, CLIP's normalisation.
PROCESSOR = {
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 64,
    "max_pixels": 1024,
    "image_token_id": IMAGE,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
CONFIG = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean"}
TURNS = 4


def make_model() -> torch.nn.Module:
    """A 2-layer Qwen2.5-VL with a 2-block vision tower, float64, its RMSNorms kept in float64."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=24,
            num_heads=2,
            out_hidden_size=32,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=16,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float64).eval()

    def rms(self: Any, x: torch.Tensor) -> torch.Tensor:  # HF's RMSNorm rounds through float32
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = rms.__get__(m)
    return model


def screenshot(step: int) -> np.ndarray:
    """A 28x36 "screen": a background, a window and a cursor that moves each step."""
    r = np.random.default_rng(step)
    img = np.full((28, 36, 3), 230, dtype=np.uint8)
    img[4:20, 3:30] = r.integers(40, 200, 3, dtype=np.uint8)
    img[6 + step * 3 : 9 + step * 3, 5 + step * 5 : 8 + step * 5] = 0
    return img


def episode() -> tuple[list[list[Any]], list[list[int]], dict[str, np.ndarray]]:
    """The calls (token ids and screenshot names), their loss masks (the action only) and the screenshots."""
    shots = {f"screen{k}": screenshot(k) for k in range(TURNS)}
    history: list[Any] = [1, 2, 3, 4]  # the system prompt
    calls, masks = [], []
    for k in range(TURNS):
        history += [START, f"screen{k}", END, 10 + k]  # the observation: a screenshot and a line of text
        actions = [[30 + k, 40 + k, 50 + k]] if k < TURNS - 1 else [[60, 61, 62], [70, 71]]  # the last call sampled twice
        for action in actions:
            calls.append(history + action)
            masks.append([0] * len(history) + [1] * len(action))
        history = history + actions[0]
    return calls, masks, shots


class EncoderCount:
    """Counts the images the vision tower encodes (rows of the grid it is given)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.images = 0
        model.model.visual.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.images += int(kwargs["grid_thw"].shape[0])


def unpacked(model: torch.nn.Module, calls: list[list[Any]], shots: dict[str, np.ndarray], batch: Any) -> torch.Tensor:
    """Each call alone through the model's own forward: node logprobs of ``naive_batch(batch)`` (node = occurrence)."""
    proc = Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "image_token_id"})
    out = torch.full((batch.num_occurrences,), float("nan"), dtype=torch.float64)
    for s, call in enumerate(calls):
        ids, pixels, grids = [], [], []
        for el in call:
            if isinstance(el, str):
                p = proc(images=[shots[el]], input_data_format="channels_last", return_tensors="pt")
                pixels.append(p["pixel_values"])
                grids.append(p["image_grid_thw"])
                ids += [IMAGE] * (int(p["image_grid_thw"].prod()) // PROCESSOR["merge_size"] ** 2)
            else:
                ids.append(el)
        tok = torch.tensor([ids])
        logits = model(
            input_ids=tok, pixel_values=torch.cat(pixels).double(), image_grid_thw=torch.cat(grids), mm_token_type_ids=(tok == IMAGE).int()
        ).logits[0]
        a = int(batch.seq_offsets[s])
        out[a + 1 : a + len(ids)] = logits[:-1].log_softmax(-1).gather(1, tok[0, 1:, None])[:, 0]
    return out


def main() -> None:
    calls, masks, shots = episode()
    mb = treepack.pack_images(calls, shots, PROCESSOR, loss_mask=masks, advantages=[1.0, -0.5, 0.5, 1.5, -1.0])
    problems = treepack.check_invariants(mb)
    assert not problems, problems
    r = np.random.default_rng(1)
    mb.old_logprobs = (-r.random(len(mb.seq_positions)) * 3).astype(np.float32)
    batch = tpt.from_microbatch(mb)
    naive = tpt.naive_batch(batch)
    shown = sum(isinstance(el, str) for call in calls for el in call)
    print(f"{len(calls)} calls, {shown} screenshots sent, {batch.num_images} distinct")
    print(f"tokens: {batch.num_occurrences} naive -> {batch.num_nodes} packed nodes ({batch.num_occurrences / batch.num_nodes:.2f}x)")

    stock = make_model()
    model = copy.deepcopy(stock)
    model.set_attn_implementation("treepack")
    packed_count, stock_count = EncoderCount(model), EncoderCount(stock)

    lp = tpt.packed_logprobs(model, batch).logprobs
    loss, _ = tpt.packed_loss(lp, batch, CONFIG)
    loss.backward()
    reference = unpacked(stock, calls, shots, batch)
    ref_loss, _ = tpt.packed_loss(reference, naive, CONFIG)
    ref_loss.backward()
    print(
        f"vision encoder: {packed_count.images} images encoded packed (once per distinct image), "
        f"{stock_count.images} unpacked (once per call)"
    )

    trained = batch.loss_mask
    occ = tpt.gather_occurrences(lp, batch)
    grads = [(p.grad - q.grad).abs().max() for p, q in zip(model.parameters(), stock.parameters())]
    vision_grads = [(p.grad - q.grad).abs().max() for p, q in zip(model.model.visual.parameters(), stock.model.visual.parameters())]
    for m in (model, stock):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    result = {
        "calls": len(calls),
        "naive_tokens": batch.num_occurrences,
        "packed_tokens": batch.num_nodes,
        "images_sent": shown,
        "encoded_packed": packed_count.images,
        "encoded_unpacked": stock_count.images,
        "max_diff_logprobs": float((occ[trained] - reference[trained]).detach().abs().max()),
        "max_diff_loss": float((loss - ref_loss).detach().abs()),
        "max_diff_gradients": float(torch.stack(grads).max()),
        "max_diff_vision_gradients": float(torch.stack(vision_grads).max()),
        "max_diff_weights_after_step": float(max((p - q).detach().abs().max() for p, q in zip(model.parameters(), stock.parameters()))),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
