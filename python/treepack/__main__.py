"""``python -m treepack check FILE|DIR... [--vocab-size V]``: prints each file's status (format, shapes, forest
invariants, values a trainer would misread); exit status 1 if any file is invalid, 2 for bad usage.

A directory is checked as a packed output directory: its manifest, then every file the manifest names, each
against its entry.

``python -m treepack info``: where the C libraries were found (the CPU core, and the optional CUDA library or why it
is not loaded); exit status 1 when the CPU core is missing."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import _native
from .microbatch import TreepackError, check_entry, check_invariants, check_values, load, read_manifest


def _targets(paths: list[str]) -> tuple[list[tuple[str, dict[str, Any] | None]], bool]:
    """Files to check, each with its manifest entry when it comes from a directory; False if a manifest failed."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    ok = True
    for path in paths:
        if not os.path.isdir(path):
            out.append((path, None))
            continue
        try:
            entries = read_manifest(path)["micro_batches"]
        except TreepackError as e:
            where = "" if e.field is None else f" (field {e.field})"
            print(f"{e.file}: error [{e.code}]{where}: {e.reason}")
            ok = False
            continue
        out.extend((os.path.join(path, *e["file"].split("/")), e) for e in entries)
    return out, ok


def check(paths: list[str], vocab_size: int | None = None) -> int:
    targets, ok = _targets(paths)
    failed = not ok
    for path, entry in targets:
        try:
            mb = load(path)
            if entry is not None:
                check_entry(mb, entry, path)
        except TreepackError as e:
            where = "" if e.field is None else f" (field {e.field})"
            print(f"{path}: error [{e.code}]{where}: {e.reason}")
            failed = True
            continue
        violations = check_invariants(mb) + check_values(mb, vocab_size)
        if violations:
            failed = True
            print(f"{path}: {len(violations)} violation(s)")
            for v in violations:
                print(f"  {v}")
        else:
            m = mb.meta
            print(f"{path}: OK ({m['num_sequences']} sequences, {m['num_tokens_naive']} naive -> {m['num_tokens_packed']} packed tokens)")
    return 1 if failed else 0


def info() -> int:
    try:
        print(f"core: {_native.core()._name}")
    except TreepackError as e:
        print(f"core: {e.reason}")
        return 1
    cuda = _native.cuda_status()
    print(f"cuda: {_native.cuda()._name if not cuda else cuda}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treepack", description="treepack micro-batch tools")
    commands = parser.add_subparsers(dest="command", required=True)
    check_cmd = commands.add_parser(
        "check", help="check micro-batch files, or packed directories by their manifest: format, shapes, forest invariants, values"
    )
    check_cmd.add_argument("files", nargs="+", metavar="FILE|DIR")
    check_cmd.add_argument("--vocab-size", type=int, default=None, metavar="V", help="also reject input_ids >= V")
    commands.add_parser("info", help="where the C libraries were found (CPU core, optional CUDA library)")
    args = parser.parse_args(argv)
    return info() if args.command == "info" else check(args.files, args.vocab_size)


if __name__ == "__main__":
    sys.exit(main())
