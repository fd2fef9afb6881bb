"""TRL on ``treepack serve``: ``TreepackGRPOTrainer(packed_batches=FeedClient(url))`` against the same micro-batches
packed by ``treepack pack`` from the gateway's exported records and trained through the directory path
(``PackedDataset``), float64 tiny Qwen3; called by test/serve-trl.test.ts in two processes:

    python feed_trl.py first SPEC.json    the reference, two negative controls, TRL on service A's feed; then TRL on
                                          service B's (a replay of A's log) dying in its second optimizer step, after
                                          pulling and before acknowledging (exits DIED, its checkpoint of step 1 kept)
    python feed_trl.py resume SPEC.json   a new trainer process resumes from that checkpoint on service B's feed;
                                          prints the comparison as JSON

SPEC: ``{"feed": URL_A, "restart": URL_B, "reference": [step dirs], "tokenizer": DIR, "work": DIR}``. Where TRL is
missing, ``first`` prints ``{"skip": reason}`` (test_trl_grpo raises instead under TREEPACK_REQUIRE_TORCH=1).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support import CORE_SKIP, TORCH_SKIP, patch_norms_to_input_dtype, tiny_model, torch  # noqa: E402
from treepack.client import FeedClient  # noqa: E402

DIED = 75  # the dying trainer's exit status: the test tells its death from a failure
FIELDS = ("input_ids", "parent", "seq_offsets", "seq_positions", "loss_mask", "advantages", "rollout_logprobs")


class RecordingFeed(FeedClient):
    """A ``FeedClient`` that writes down its hand-outs and acknowledgements (ids, in order) as they happen, so a
    trainer process that dies leaves its record behind."""

    def __init__(self, url: str, log: str, rank: int = 0, dp: int = 1):
        super().__init__(url, rank=rank, dp=dp, wait=30)
        self.log, self.events, self.batches = log, [], []

    def next(self):
        mb = super().next()
        if mb is not None:
            self.events.append(("pulled", mb.id))
            self.batches.append(mb.batch)
            self._write()
        return mb

    def ack(self, id):
        out = super().ack(id)
        self.events.append(("acked", id))
        self._write()
        return out

    def _write(self):
        with open(self.log, "w") as f:
            json.dump(self.events, f)


def trainer(spec: dict, source, name: str, die_at_step: int = 0, checkpoint: bool = False, **cfg):
    """TRL's trainer on ``source`` (one stored micro-batch per TRL micro-batch, one step's micro-batches per
    optimizer step), float64, from the saved tiny model; ``die_at_step``: the process exits DIED in the loss of that
    optimizer step (its micro-batches pulled, none acknowledged), its logs so far saved; ``cfg``: more GRPOConfig."""
    from test_trl_grpo import Capture, patch_rope_to_float64
    from transformers import AutoTokenizer
    from treepack.integrations.trl import TreepackGRPOTrainer
    from trl import GRPOConfig

    k = spec["micro_batches_per_step"]
    args = GRPOConfig(
        output_dir=os.path.join(spec["work"], name),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=k,
        steps_per_generation=k,
        max_steps=len(spec["reference"]),
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        beta=0.04,
        loss_type="dapo",
        temperature=0.7,
        disable_tqdm=True,
        save_strategy="steps" if checkpoint else "no",
        save_steps=1,
        model_init_kwargs={"attn_implementation": "treepack", "dtype": torch.float64},
        **cfg,
    )
    capture = Capture()

    class Trainer(TreepackGRPOTrainer):
        def compute_loss(self, *a, **kw):
            if die_at_step and self.state.global_step + 1 == die_at_step:
                with open(os.path.join(spec["work"], f"{name}-logs.json"), "w") as f:
                    json.dump(capture.logs, f)
                os._exit(DIED)
            return super().compute_loss(*a, **kw)

    t = Trainer(
        model=spec["model"],
        args=args,
        processing_class=AutoTokenizer.from_pretrained(spec["tokenizer"]),
        callbacks=[capture],
        packed_batches=source,
    )
    for m in (t.model, t.ref_model):
        if m is not None:
            patch_norms_to_input_dtype(m)
            patch_rope_to_float64(m)
    return t, capture


def result(t, capture) -> dict:
    """Every parameter after training and the per-step logs (the run's summary line left out)."""
    return {"params": {n: p.detach().clone() for n, p in t.model.named_parameters()}, "logs": step_logs(capture.logs)}


def step_logs(logs: list) -> list:
    return [{k: v for k, v in log.items() if "time" not in k and "per_second" not in k} for log in logs if "loss" in log]


def holes(batch) -> int:
    """Sequences whose loss mask has an untrained token between two trained ones (a tool result, a user turn)."""
    n = 0
    for i in range(batch.num_sequences):
        trained = batch.loss_mask[batch.seq_offsets[i] : batch.seq_offsets[i + 1]].nonzero()
        n += len(trained) > 0 and int(trained[-1]) - int(trained[0]) + 1 > len(trained)
    return n


def param_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def diff(ref: dict, got: dict) -> dict:
    """Two runs' ``result``s: the largest parameter difference and the largest relative logged-value difference."""
    return {"params": param_diff(ref["params"], got["params"]), "logs": log_diff(ref["logs"], got["logs"])}


def changed_advantage(flat: list) -> list:
    """The negative control's micro-batches: the last one's advantages moved by 0.25."""
    return flat[:-1] + [dataclasses.replace(flat[-1], advantages=flat[-1].advantages + 0.25)]


def log_diff(a: list, b: list) -> float:
    """The largest relative difference of any logged value; inf when the steps or keys differ."""
    if len(a) != len(b) or any(sorted(x) != sorted(y) for x, y in zip(a, b)):
        return float("inf")
    return max((abs(x[k] - y[k]) / max(1.0, abs(x[k])) for x, y in zip(a, b) for k in x), default=0.0)


def skipped() -> bool:
    """Prints ``{"skip": reason}`` and says so where the C core, torch or TRL is missing (test_trl_grpo needs torch
    to import; it raises where TRL is missing under TREEPACK_REQUIRE_TORCH=1)."""
    reason = CORE_SKIP or TORCH_SKIP
    if not reason:
        from test_trl_grpo import TRL_SKIP as reason
    if reason:
        print(json.dumps({"skip": reason}))
    return bool(reason)


def prepare(spec: dict, dp: int = 1) -> list:
    """Reads the reference step directories (each rank's share with ``dp`` > 1), checks that every step has as many
    micro-batches per rank (one TRL window each), saves the tiny model and the spec; the micro-batches of each rank
    in feed order."""
    from treepack.torch import PackedDataset

    torch.set_num_threads(1)
    ranks = [[list(PackedDataset(d, **({"rank": r, "dp": dp} if dp > 1 else {}))) for d in spec["reference"]] for r in range(dp)]
    counts = {len(step) for steps in ranks for step in steps}
    if len(counts) != 1:
        per_rank = [[len(s) for s in st] for st in ranks]
        raise SystemExit(f"every step must have as many micro-batches per rank for one TRL window each; the reference has {per_rank}")
    spec["micro_batches_per_step"] = counts.pop()
    spec["model"] = os.path.join(spec["work"], "model")
    flat = [[b for step in steps for b in step] for steps in ranks]
    tiny_model("qwen3", torch.float32, attn="sdpa", vocab=flat[0][0].vocab_size).save_pretrained(spec["model"])
    with open(os.path.join(spec["work"], "spec.json"), "w") as f:
        json.dump(spec, f)
    return flat


def tokens(flat: list) -> dict:
    """What the micro-batches hold: tokens naive, packed and pad, sequences (per micro-batch in ``rows``), loss-mask
    holes, and how many hang from a cached prefix of a step plan."""
    return {
        "naive": sum(b.num_occurrences for b in flat),
        "packed": sum(b.num_nodes for b in flat),
        "pad": sum(b.num_pad_tokens for b in flat),
        "micro_batches": len(flat),
        "sequences": sum(b.num_sequences for b in flat),
        "holes": sum(map(holes, flat)),
        "rows": [b.num_sequences for b in flat],
        "hanging": sum(int(b.meta.get("prefix_tokens", 0)) > 0 for b in flat),
    }


def same_batches(got: list, want: list) -> bool:
    """The feed handed out exactly the reference's micro-batches, in order (tensors and step-plan headers)."""
    plan = ("prefix_tokens", "prefix_push", "prefix_release")
    return len(got) == len(want) and all(
        all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS) and [a.meta.get(k) for k in plan] == [b.meta.get(k) for k in plan]
        for a, b in zip(got, want)
    )


def first(spec: dict) -> None:
    if skipped():
        return
    from treepack.torch import PackedDataset

    [flat] = prepare(spec)
    out = {"tokens": tokens(flat)}
    began = time.time()

    # The reference: the directory path, each step's directory read by PackedDataset in turn.
    t, cap = trainer(spec, itertools.chain(*(PackedDataset(d) for d in spec["reference"])), "reference")
    t.train()
    ref = result(t, cap)
    out["reference_s"] = time.time() - began
    out["reference_logs"] = ref["logs"]

    # Negative controls: the comparison tells a changed advantage, and a micro-batch trained twice in place of another.
    twice = flat[:-1] + [flat[-2]]
    out["controls"] = {}
    began = time.time()
    for name, batches in (("advantage", changed_advantage(flat)), ("twice", twice)):
        t, cap = trainer(spec, batches, name)
        t.train()
        out["controls"][name] = diff(ref, result(t, cap))
    out["controls_s"] = time.time() - began

    # TRL on service A's feed.
    began = time.time()
    feed = RecordingFeed(spec["feed"], os.path.join(spec["work"], "feed-events.json"))
    t, cap = trainer(spec, feed, "feed")
    t.train()
    got = result(t, cap)
    out["feed_s"] = time.time() - began
    out["feed"] = {
        **diff(ref, got),
        "events": feed.events,
        "same_batches": same_batches(feed.batches, flat),
        "nodes": [int(b.num_nodes) for b in feed.batches],
        "stats": [list(s) for s in t.treepack_stats],
    }
    torch.save({"reference": ref, "out": out}, os.path.join(spec["work"], "first.pt"))

    # Service B: the trainer dies in its second step.
    feed = RecordingFeed(spec["restart"], os.path.join(spec["work"], "died-events.json"))
    t, cap = trainer(spec, feed, "restart", die_at_step=2, checkpoint=True)
    t.train()
    raise SystemExit("the dying trainer finished its training")


def resume(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    work = spec["work"]
    saved = torch.load(os.path.join(work, "first.pt"))
    ref, out = saved["reference"], saved["out"]
    with open(os.path.join(work, "restart-logs.json")) as f:
        died_logs = step_logs(json.load(f))
    with open(os.path.join(work, "died-events.json")) as f:
        died_events = json.load(f)
    began = time.time()
    feed = RecordingFeed(spec["restart"], os.path.join(work, "resumed-events.json"))
    t, cap = trainer(spec, feed, "restart")
    t.train(resume_from_checkpoint=os.path.join(work, "restart", "checkpoint-1"))
    got = result(t, cap)
    out["restart_s"] = time.time() - began
    out["restart"] = {
        "params": param_diff(ref["params"], got["params"]),
        "logs": log_diff(ref["logs"], died_logs + got["logs"]),
        "died_events": died_events,
        "resumed_events": feed.events,
        "died_logs": len(died_logs),
        "resumed_logs": len(got["logs"]),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        spec = json.load(f)
    if sys.argv[1] == "first":
        first(spec)
    else:
        resume(os.path.join(spec["work"], "spec.json"))
