"""One rank of test_trl_packed.TRLOnMicroBatchesTest.test_step_plan_under_ddp (two CPU processes, gloo, through
accelerate as `accelerate launch` would set it up): TRL on this rank's planned micro-batches through the step-plan
executor, against TRL's stock GRPOTrainer under DDP on the same micro-batches fed as plain inputs, and the planned run
with its one all-reduce skipped (the control). Saves each run's gradients and logs to OUT/rank{r}.pt."""

from __future__ import annotations

import os


def launch_env(rank: int, world: int, port: int) -> None:
    """The environment `accelerate launch` (or torchrun) gives rank ``rank`` of ``world`` processes on this host."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def worker(rank: int, world: int, port: int, model_path: str, packed: str, samples: list, out: str) -> None:
    launch_env(rank, world, port)
    import torch
    from test_trl_grpo import tokenizer
    from test_trl_packed import TRLOnMicroBatchesTest
    from treepack.torch import PackedDataset, StepPlanRunner

    batches = list(PackedDataset(packed, rank=rank, dp=world))  # this rank's micro-batches, in plan order
    rows = [dict(samples[int(sid[1:])], mb=mb) for mb, b in enumerate(batches) for sid in b.meta["sequence_ids"]]
    num_items = sum(sum(x["mask"]) for x in samples)  # the step's trainable tokens over every rank, as TRL gathers them

    t = TRLOnMicroBatchesTest("test_step_plan_under_ddp")
    t.tmp, t.tok, t.path = type("Tmp", (), {"name": os.path.join(out, f"trainer{rank}")})(), tokenizer(), model_path
    common = dict(rows=rows, num_items=num_items, world=world, loss_type="dapo", ddp_backend="gloo")
    report = {}
    _, cap = t.run_trainer(False, False, **common)
    report["plain"] = (cap.grads, cap.logs)
    trainer, cap = t.run_trainer(True, False, feed=batches, **common)
    report["planned"] = (cap.grads, cap.logs)
    report["pushed"] = trainer.__dict__["_treepack_plan"].pushed
    report["wrapper"] = type(trainer.model_wrapped).__name__
    sync, StepPlanRunner.sync_gradients = StepPlanRunner.sync_gradients, lambda self: None
    try:
        _, cap = t.run_trainer(True, False, feed=batches, **common)
    finally:
        StepPlanRunner.sync_gradients = sync
    report["unsynced"] = (cap.grads, cap.logs)
    torch.save(report, os.path.join(out, f"rank{rank}.pt"))
