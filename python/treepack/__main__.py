"""``python -m treepack check FILE... [--vocab-size V]``: prints each file's status (format, shapes, forest invariants,
values a trainer would misread); exit status 1 if any file is invalid, 2 for bad usage."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .microbatch import TreepackError, check_invariants, check_values, load


def check(files: List[str], vocab_size: Optional[int] = None) -> int:
    failed = False
    for path in files:
        try:
            mb = load(path)
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
            print(
                f"{path}: OK ({m['num_sequences']} sequences, "
                f"{m['num_tokens_naive']} naive -> {m['num_tokens_packed']} packed tokens)"
            )
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treepack", description="treepack micro-batch tools")
    commands = parser.add_subparsers(dest="command", required=True)
    check_cmd = commands.add_parser("check", help="check micro-batch files: format, shapes and forest invariants")
    check_cmd.add_argument("files", nargs="+", metavar="FILE")
    check_cmd.add_argument("--vocab-size", type=int, default=None, metavar="V", help="also reject input_ids >= V")
    args = parser.parse_args(argv)
    return check(args.files, args.vocab_size)


if __name__ == "__main__":
    sys.exit(main())
