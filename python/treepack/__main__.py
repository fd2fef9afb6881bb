"""``python -m treepack check FILE...``: prints each file's status; exit status 1 if any file is invalid."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .microbatch import TreepackError, check_invariants, load


def check(files: List[str]) -> int:
    failed = False
    for path in files:
        try:
            mb = load(path)
        except TreepackError as e:
            where = "" if e.field is None else f" (field {e.field})"
            print(f"{path}: error [{e.code}]{where}: {e.reason}")
            failed = True
            continue
        violations = check_invariants(mb)
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
    args = parser.parse_args(argv)
    return check(args.files)


if __name__ == "__main__":
    sys.exit(main())
