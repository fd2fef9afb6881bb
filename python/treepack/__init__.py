"""treepack on the trainer side: load packed micro-batches (shared/DESIGN.md §3) as numpy arrays and check them.

    >>> import treepack
    >>> mb = treepack.load("out/mb-000000.safetensors")
    >>> mb.sequence(0)                 # tokens of the first sequence
    >>> treepack.check_invariants(mb)  # [] when valid

``python -m treepack check FILE...`` runs the same checks from the shell.
"""

from .microbatch import (
    FORMAT,
    MicroBatch,
    SafetensorsFile,
    TreepackError,
    check_invariants,
    load,
    read_safetensors,
)

__all__ = [
    "FORMAT",
    "MicroBatch",
    "SafetensorsFile",
    "TreepackError",
    "check_invariants",
    "load",
    "read_safetensors",
]
