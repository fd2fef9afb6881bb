"""treepack on the trainer side: load packed micro-batches (docs/design.md §3) as numpy arrays and check them.

    >>> import treepack
    >>> paths = treepack.list_microbatches("packed")  # a packed directory: the files its manifest names, in order
    >>> paths
    ['packed/gen-000001/microbatch-00000.safetensors', 'packed/gen-000001/microbatch-00001.safetensors']
    >>> mb = treepack.load(paths[0])
    >>> mb.sequence(0).tolist()        # tokens of the first sequence
    [2, 3, 4, 5, 6, 7, 1]
    >>> mb.input_ids.tolist()          # its forest: the second sequence shares [2, 3, 4, 5]
    [2, 3, 4, 5, 6, 7, 1, 8, 9, 1]
    >>> treepack.check_invariants(mb)  # [] when valid
    []
    >>> treepack.check_values(mb, vocab_size=64)  # masks 0/1, ids in range, finite where trainable
    []
    >>> treepack.pack_sequences([[1, 2, 3], [1, 2, 4]]).input_ids.tolist()   # pack in process (C core)
    [1, 2, 3, 4]
    >>> treepack.LossConfig(aggregation="seq-mean-token-mean", loss_scale=8)   # the loss config, typed
    LossConfig(policy='ppo', clip_low=0.2, clip_high=0.2, ..., aggregation='seq-mean-token-mean', ..., loss_scale=8, ...)
    >>> seqs, group_ids = [[1, 2, 3], [1, 2, 4], [5, 6, 7], [5, 6, 8]], ["g1", "g1", "g2", "g2"]
    >>> plan = treepack.plan_micro_batches(seqs, max_tokens=4, groups=group_ids)  # micro-batches keeping groups whole
    >>> [mb.sequences.tolist() for mb in plan.micro_batches]
    [[0, 1], [2, 3]]

``python -m treepack check FILE|DIR...`` runs the same checks from the shell.
"""

from .images import pack_images
from .loss import LossConfig
from .microbatch import (
    FORMAT,
    MANIFEST_FILE,
    MicroBatch,
    SafetensorsFile,
    TreepackError,
    check_entry,
    check_images,
    check_invariants,
    check_values,
    list_microbatches,
    load,
    read_manifest,
    read_safetensors,
)
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
    "check_images",
    "check_invariants",
    "check_values",
    "list_microbatches",
    "load",
    "pack_images",
    "pack_sequences",
    "plan_micro_batches",
    "read_manifest",
    "read_safetensors",
]
