"""Runs Python test files or folders (unittest) for scripts/gpu-check.sh and says what ran, failed and was skipped.

    python scripts/gpu_check/run_tests.py [--require-cuda] [-k PATTERN]... PATH...

PATH is a test file or a folder (``unittest discover``, its own folder on sys.path); a missing PATH is a failure,
never a crash. ``-k`` keeps the tests whose full name (module.Class.method) contains the pattern (as unittest's
``-k``). With ``--require-cuda`` (what TREEPACK_REQUIRE_CUDA=1 means on a GPU host) the run fails where torch sees
no CUDA device, where no test ran, or where a test was skipped for a missing device (a skip reason naming CUDA, a
GPU or a device): the tests these paths hold exist to run there. Other skips (an optional package) are
listed with their reasons. Prints one ``SUMMARY:`` line; exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import unittest
from collections.abc import Sequence

DEVICE_SKIP = re.compile(r"cuda|gpu|device", re.IGNORECASE)


def load(path: str, patterns: list[str]) -> unittest.TestSuite:
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = [f"*{p}*" for p in patterns]
    if os.path.isdir(path):
        return loader.discover(start_dir=path, top_level_dir=path)
    folder = os.path.dirname(os.path.abspath(path))
    return loader.discover(start_dir=folder, pattern=os.path.basename(path), top_level_dir=folder)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("-k", dest="patterns", action="append", default=[])
    ap.add_argument("--require-cuda", action="store_true")
    a = ap.parse_args(argv)
    problems: list[str] = []
    missing = [p for p in a.paths if not os.path.exists(p)]
    problems += [f"{p} not found" for p in missing]
    if a.require_cuda:
        try:
            import torch

            if not torch.cuda.is_available():
                problems.append(f"torch {torch.__version__} sees no CUDA device")
        except ImportError as e:
            problems.append(f"torch does not import ({e})")
    suite = unittest.TestSuite()
    for p in a.paths:
        if p not in missing:
            suite.addTests(load(p, a.patterns))
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    reasons: dict[str, int] = {}
    for _, why in result.skipped:
        reasons[why] = reasons.get(why, 0) + 1
    # Without --require-cuda a device skip is one skip among others, listed below.
    device_skips = [why for why in reasons if DEVICE_SKIP.search(why)] if a.require_cuda else []
    ran = result.testsRun - len(result.skipped)
    if device_skips:
        problems.append("skipped for want of a device: " + "; ".join(device_skips))
    if ran == 0 and not missing:
        problems.append("no test ran")
    if result.failures or result.errors:
        names = [t.id().split(".", 1)[-1] for t, _ in result.failures + result.errors]
        more = " …" if len(names) > 6 else ""
        problems.append(f"{len(result.failures)} failed, {len(result.errors)} errors: {', '.join(names[:6])}{more}")
    others = [f"{n} × {why}" for why, n in reasons.items() if why not in device_skips]
    failed = len(result.failures) + len(result.errors)
    line = f"{ran - failed} passed, {failed} failed, {len(result.skipped)} skipped"
    if others:
        line += " (" + "; ".join(others) + ")"
    if problems:
        line += "; " + "; ".join(problems)
    print(f"SUMMARY: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
