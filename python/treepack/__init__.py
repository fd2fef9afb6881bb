"""treepack on the trainer side: load packed micro-batches (shared/DESIGN.md §3) as numpy arrays and check them.

    >>> import treepack
    >>> mb = treepack.load("out/mb-000000.safetensors")
    >>> mb.sequence(0)                 # tokens of the first sequence
    >>> treepack.check_invariants(mb)  # [] when valid
    >>> treepack.pack_sequences([[1, 2, 3], [1, 2, 4]])   # pack in process (C core)
    >>> treepack.LossConfig(aggregation="seq-mean-token-mean", loss_scale=8)   # the loss config, typed
    >>> treepack.plan_micro_batches(seqs, max_tokens=8192, groups=group_ids)  # micro-batches keeping groups whole
    >>> treepack.check_values(mb, vocab_size=151936)  # masks 0/1, ids in range, finite where trainable
    >>> treepack.list_microbatches("out")  # a packed directory: the files its manifest names, in order

``python -m treepack check FILE|DIR...`` runs the same checks from the shell.
"""

from .microbatch import (
    FORMAT,
    MANIFEST_FILE,
    MicroBatch,
    SafetensorsFile,
    TreepackError,
    check_entry,
    check_invariants,
    check_values,
    list_microbatches,
    load,
    read_manifest,
    read_safetensors,
)

from .loss import LossConfig
from .pack import pack_sequences
from .plan import MicroBatchPlan, Plan, plan_micro_batches

__all__ = [
    "FORMAT",
    "LossConfig",
    "MANIFEST_FILE",
    "MicroBatch",
    "MicroBatchPlan",
    "Plan",
    "SafetensorsFile",
    "TreepackError",
    "check_entry",
    "check_invariants",
    "check_values",
    "list_microbatches",
    "load",
    "pack_sequences",
    "plan_micro_batches",
    "read_manifest",
    "read_safetensors",
]
