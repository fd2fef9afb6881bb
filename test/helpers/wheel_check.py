"""The Python side of test/python-wheel.test.ts, run by a clean venv's Python from a directory outside the checkout,
with treepack installed from the wheel (numpy and safetensors from the index, no torch). Reads one JSON request on
stdin, prints one JSON object:

  {"checkout": ROOT, "ts_file": PATH, "ts_arrays": {name: [...]}, "fixture": PATH}
  -> {"module", "core", "cuda", "packed", "loss", "fixture_aggregations", "loaded", "block_sizes"}

Every check asserts; the references are plain Python (occurrences written out, a float64 PPO formula, the dense
mask rule) or the fixture test/fixtures/loss_reference.json, none of them the package's own code.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import safetensors.numpy
import treepack
from treepack import TreepackError, _native
from treepack.flex import block_arrays_from_tree
from treepack.loss import loss_numpy

req = json.load(sys.stdin)
root = os.path.realpath(req["checkout"])
sys.path.insert(0, os.path.join(root, "python", "tests"))  # the tests' references only: no treepack there
from mask_reference import block_arrays_from_dense, dense_mask  # noqa: E402

out = {}
here = os.path.dirname(os.path.realpath(treepack.__file__))
assert not here.startswith(root + os.sep), f"treepack imported from the checkout: {here}"
assert os.getcwd() != root and not os.path.realpath(os.getcwd()).startswith(root + os.sep)
out["module"] = here
out["core"] = _native.core()._name
assert out["core"] == os.path.join(here, _native.CORE), out["core"]

# The optional CUDA library: reported, never fatal.
out["cuda"] = _native.cuda_status()
assert "libtreepack_cuda.so not loaded" in out["cuda"], out["cuda"]
info = subprocess.run(
    [sys.executable, "-m", "treepack", "info"],
    capture_output=True,
    text=True,
    env={**os.environ, "TREEPACK_CUDA_LIB": "/nonexistent/libtreepack_cuda.so"},
)
assert info.returncode == 0, info.stderr
assert "cuda: libtreepack_cuda.so not loaded (tried /nonexistent/libtreepack_cuda.so: not found)" in info.stdout, info.stdout

# pack_sequences with per-token fields; every value at its (sequence, t).
rnd = np.random.default_rng(5)
seqs = [[7, 1, 2, 3], [7, 1, 2, 4, 5], [7, 1, 9], [8], [7, 1, 2, 3, 6]]
masks = [[0] + [int(t >= 2) for t in range(1, len(s))] for s in seqs]
adv = [1.0, -0.5, [0.0, 0.3, 0.7], 2.0, -1.0]
old = [[float(-rnd.random()) for _ in s] for s in seqs]
mb = treepack.pack_sequences(seqs, loss_mask=masks, advantages=adv, old_logprobs=old)
assert treepack.check_invariants(mb) == [], treepack.check_invariants(mb)
k = 0
for i, s in enumerate(seqs):
    for t, tok in enumerate(s):
        assert mb.input_ids[mb.seq_positions[k]] == tok
        assert mb.loss_mask[k] == masks[i][t]
        a = adv[i] if np.ndim(adv[i]) == 0 else adv[i][t]
        assert mb.advantages[k] == np.float32(a if masks[i][t] else 0.0), (i, t)
        assert mb.old_logprobs[k] == np.float32(old[i][t])
        k += 1
try:
    treepack.pack_sequences(seqs, loss_mask=[[1] + m[1:] for m in masks])
    raise AssertionError("a loss_mask of 1 at t = 0 was accepted")
except TreepackError as e:
    assert e.field == "loss_mask" and "sequence 0" in str(e), str(e)
out["packed"] = [int(mb.meta["num_tokens_naive"]), int(mb.meta["num_tokens_packed"])]

# loss_numpy against PPO token-mean written out in float64, per occurrence (clip 0.2, no KL).
lp = (-rnd.random(len(mb.input_ids))).astype(np.float32)
loss, grad, metrics = loss_numpy(mb, lp, {"clip_low": 0.2})
want, want_grad, n = 0.0, np.zeros(len(lp)), int(mb.loss_mask.sum())
for k in np.flatnonzero(mb.loss_mask):
    p, A = mb.seq_positions[k], float(mb.advantages[k])
    r = math.exp(float(lp[p]) - float(mb.old_logprobs[k]))
    unclipped, clipped = -A * r, -A * min(max(r, 0.8), 1.2)
    want += max(unclipped, clipped) / n
    if unclipped >= clipped:  # the unclipped branch carries the gradient
        want_grad[p] += -A * r / n
assert abs(loss - want) < 1e-6, (loss, want)
assert np.abs(grad - want_grad).max() < 1e-6, (grad, want_grad)
assert metrics["trainable_tokens"] == n
out["loss"] = loss

# The fixture: every aggregation's expected loss.
from test_loss import fixture_batch  # noqa: E402  (python/tests: the fixture's layout as the suites read it)

with open(req["fixture"]) as f:
    fx = json.load(f)
batch, flp = fixture_batch(fx)
p = fx["params"]
base = {"clip_low": p["clip_low"], "clip_high": p["clip_high"], "dual_clip": p["dual_clip_c"], "log_ratio_clamp": p["log_ratio_clamp"]}
out["fixture_aggregations"] = 0
for agg, expected in fx["expected"]["loss"].items():
    got = loss_numpy(batch, flp, {**base, "aggregation": agg, "norm_constant": 3})[0]
    assert abs(got - expected) < 1e-6, (agg, got, expected)
    out["fixture_aggregations"] += 1

# load: the file the TypeScript side wrote, and one written by safetensors itself.
ts = treepack.load(req["ts_file"])
for name, values in req["ts_arrays"].items():
    assert getattr(ts, name).tolist() == values, name
assert treepack.check_invariants(ts) == []
names = ["input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions", "loss_mask", "advantages", "old_logprobs"]
meta = {
    "format": "treepack/1",
    "num_sequences": str(len(seqs)),
    "num_tokens_naive": str(len(mb.seq_positions)),
    "num_tokens_packed": str(len(mb.input_ids)),
    "tokenizer": "t",
    "sequence_ids": json.dumps(mb.meta["sequence_ids"]),
}
raw = safetensors.numpy.save({n: np.asarray(getattr(mb, n)) for n in names}, metadata=meta)
back = treepack.load(raw)
for n in names:
    assert np.array_equal(getattr(back, n), getattr(mb, n)), n
out["loaded"] = [len(ts.input_ids), len(back.input_ids)]

# Block arrays from the C core against the dense rule.
for B in (1, 2, 3, 16):
    got, want_blocks = block_arrays_from_tree(ts.subtree_end, B), block_arrays_from_dense(dense_mask(ts.subtree_end), B)
    for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert np.array_equal(getattr(got, f), getattr(want_blocks, f)), (B, f)
out["block_sizes"] = [1, 2, 3, 16]

print(json.dumps(out))
