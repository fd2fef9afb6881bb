"""transformers' answers for test/images-python.test.ts: reads cases (JSON) on stdin, prints transformers' results.

Image processor: Qwen2VLImageProcessorPil (the class Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors use), both its
placeholder arithmetic (get_number_of_image_patches) and a real call on an image of each size. Rotary positions:
get_rope_index of Qwen2_5_VLModel and Qwen3VLModel, called on a stand-in `self` that holds only their config.
"""

import json
import sys
import types

import numpy as np
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

MODELS = {"qwen2_5_vl": Qwen2_5_VLModel, "qwen3_vl": Qwen3VLModel}


def processor_case(case):
    s = case["settings"]
    proc = Qwen2VLImageProcessorPil(
        patch_size=s["patch_size"],
        merge_size=s["merge_size"],
        temporal_patch_size=s["temporal_patch_size"],
        min_pixels=s["min_pixels"],
        max_pixels=s["max_pixels"],
    )
    out = []
    for h, w in case["sizes"]:
        try:
            patches = proc.get_number_of_image_patches(h, w, {})
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        entry = {"patches": patches}
        if h * w <= 1 << 18:  # a real call on smaller images too (the resize is what costs)
            grid = proc(images=[np.zeros((h, w, 3), dtype=np.uint8)], return_tensors="np", input_data_format="channels_last")[
                "image_grid_thw"
            ]
            entry["grid"] = [int(x) for x in grid[0]]
        out.append(entry)
    return out


def rope_case(case):
    cls = MODELS[case["family"]]
    vision = types.SimpleNamespace(spatial_merge_size=case["merge_size"], tokens_per_second=2)
    me = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    me.get_vision_position_ids = lambda *a, **k: cls.get_vision_position_ids(me, *a, **k)
    ids = torch.tensor([case["tokens"]])
    types_ = (ids == case["image_token_id"]).int()
    grids = torch.tensor(case["grids"]) if case["grids"] else None
    pos, _ = cls.get_rope_index(me, ids, types_, image_grid_thw=grids)
    return pos[:, 0, :].tolist()


cases = json.load(sys.stdin)
print(json.dumps({"processor": [processor_case(c) for c in cases["processor"]], "rope": [rope_case(c) for c in cases["rope"]]}))
