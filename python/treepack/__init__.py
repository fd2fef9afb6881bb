"""treepack on the trainer side: load packed micro-batches (shared/DESIGN.md §3) as numpy arrays and check them.

    >>> import treepack
    >>> mb = treepack.load("out/mb-000000.safetensors")
    >>> mb.sequence(0)                 # tokens of the first sequence
    >>> treepack.check_invariants(mb)  # [] when valid
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
    list_microbatches,
    load,
    read_manifest,
    read_safetensors,
)

__all__ = [
    "FORMAT",
    "MANIFEST_FILE",
    "MicroBatch",
    "SafetensorsFile",
    "TreepackError",
    "check_entry",
    "check_invariants",
    "list_microbatches",
    "load",
    "read_manifest",
    "read_safetensors",
]
