"""treepack on the trainer side: load packed micro-batches (shared/DESIGN.md §3) as numpy arrays and check them.

    >>> import treepack
    >>> mb = treepack.load("out/mb-000000.safetensors")
    >>> mb.sequence(0)                 # tokens of the first sequence
    >>> treepack.check_invariants(mb)  # [] when valid
    >>> treepack.pack_sequences([[1, 2, 3], [1, 2, 4]])   # pack in process (C core)
    >>> treepack.check_values(mb, vocab_size=151936)  # masks 0/1, ids in range, finite where trainable

``python -m treepack check FILE...`` runs the same checks from the shell.
"""

from .microbatch import (
    FORMAT,
    MicroBatch,
    SafetensorsFile,
    TreepackError,
    check_invariants,
    check_values,
    load,
    read_safetensors,
)

from .pack import pack_sequences

__all__ = [
    "FORMAT",
    "MicroBatch",
    "SafetensorsFile",
    "TreepackError",
    "check_invariants",
    "check_values",
    "load",
    "pack_sequences",
    "read_safetensors",
]
