"""The Python side of test/abi.test.ts: reads one JSON request on stdin, answers one JSON object on stdout.

{"mode": "loss", "batch": {...arrays...}, "lp": [...], "configs": [...]}
    -> {"results": [{"loss", "grad", "metrics"} | {"error"}]}   loss_numpy per config (ctypes, libtreepack_core.so)
{"mode": "config", "configs": [...]} -> {"results": [{"fields": {...}} | {"error"}]}   make_config's struct
{"mode": "status", "calls": [...]} -> {"core": [...], "cuda": [...] | str}   statuses of bad calls on both C ABIs
"""

import ctypes
import json
import sys

import numpy as np
from treepack import TreepackError, _native
from treepack import loss as tl

req = json.load(sys.stdin)
out = {}

if req["mode"] == "loss":
    batch = {k: np.array(v) for k, v in req["batch"].items()}
    lp = np.array(req["lp"], dtype=np.float32)
    results = []
    for cfg in req["configs"]:
        try:
            value, grad, metrics = tl.loss_numpy(batch, lp, cfg)
            results.append({"loss": value, "grad": grad.tolist(), "metrics": metrics})
        except ValueError as e:
            results.append({"error": str(e)})
    out["results"] = results

elif req["mode"] == "config":
    results = []
    for cfg in req["configs"]:
        try:
            c = tl.make_config(cfg)
            results.append({"fields": {n: getattr(c, n) for n, _ in c._fields_}})
        except ValueError as e:
            results.append({"error": str(e)})
    out["results"] = results

elif req["mode"] == "status":
    # One small valid batch; each call breaks one argument. Arrays stay referenced until the calls are done.
    off = np.array([0, 3, 5], dtype=np.int32)
    pos = np.array([0, 1, 2, 0, 3], dtype=np.int32)
    mask = np.array([0, 1, 1, 0, 1], dtype=np.uint8)
    f = {k: np.full(5, -1.0, dtype=np.float32) for k in ("adv", "old", "ref", "roll")}
    sw = np.array([1.0, 0.5], dtype=np.float32)
    turn = np.array([-1, 0, 0, -1, 0], dtype=np.int32)
    lp = np.full(4, -1.0, dtype=np.float32)
    grad = np.zeros(4, dtype=np.float32)
    P = _native.pointer  # typed: ctypes checks each array's element type against the header's

    def args(call):
        cfg = tl.make_config(call.get("config", {}))
        for k, v in call.get("codes", {}).items():
            setattr(cfg, k, v)
        a = {"S": 2, "off": off, "M": 5, "pos": pos, "mask": mask, **f, "sw": sw, "turn": turn, "N": 4, "lp": lp, "grad": grad}
        for k, v in call.get("set", {}).items():
            a[k] = np.array(v, dtype=a[k].dtype) if isinstance(v, list) else v
        for k in call.get("null", []):
            a[k] = None
        return cfg, (
            a["S"],
            P(a["off"]),
            a["M"],
            P(a["pos"]),
            P(a["mask"]),
            P(a["adv"]),
            P(a["old"]),
            P(a["ref"]),
            P(a["roll"]),
            P(a["sw"]),
            P(a["turn"]),
            a["N"],
            P(a["lp"]),
            P(a["grad"]),
        )

    core = tl.core_library()
    out["core"] = []
    for call in req["calls"]:
        cfg, a = args(call)
        out["core"].append(core.tp_loss(ctypes.byref(cfg), *a, ctypes.byref(tl.LossMetrics())))
    try:
        cuda = tl.cuda_library()  # signatures declared by treepack._native
        out["cuda"] = []
        for call in req["calls"]:
            cfg, a = args(call)
            out["cuda"].append(cuda.tp_cuda_loss_host(ctypes.byref(cfg), *a, ctypes.byref(tl.LossMetrics())))
        out["cuda_last_error"] = cuda.tp_cuda_last_error()
    except (OSError, TreepackError) as e:  # no CUDA library built here (TreepackError E_BACKEND names it)
        out["cuda"] = str(e)

json.dump(out, sys.stdout)
