"""The versions treepack's trainer side is tested with (treepack.versions): one range per package, the same in
python/pyproject.toml's extras, the requirement files and the oldest-version pins; a transformers or TRL outside
it is refused by every piece of the patch layer (prepare, the "treepack" attention function, the dense mask, the
TRL integration's import) with a TreepackError naming the installed version and the range, unless
TREEPACK_ALLOW_UNTESTED_VERSIONS=1; the installed ones (the newest in .venv, the oldest in .venv-oldest) pass."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import unittest
import warnings
from unittest import mock

from support import needs_torch, pack, tiny_model, torch, tpt
from treepack import TreepackError
from treepack.versions import ALLOW_ENV, SUPPORTED, check_version, require

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def requirement_lines(name: str) -> dict:
    """{package: specifier} of a requirements file under python/ (comments, includes and unbounded names left out)."""
    out = {}
    with open(os.path.join(PYTHON_DIR, name)) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.-]+)\s*([<>=!~].*?)\s*(#.*)?$", line.strip())
            if m:
                out[m.group(1).lower()] = m.group(2).replace(" ", "")
    return out


@needs_torch(transformers=True)
class SupportedRanges(unittest.TestCase):
    def test_one_range_per_package_everywhere(self):
        """pyproject.toml's extras, the requirement files and SUPPORTED say the same ranges; the oldest pins are
        their lower bounds (torch's too), so .venv-oldest tests exactly the oldest release allowed."""
        import tomllib
        from packaging.requirements import Requirement
        from packaging.version import Version

        with open(os.path.join(PYTHON_DIR, "pyproject.toml"), "rb") as f:
            extras = tomllib.load(f)["project"]["optional-dependencies"]
        declared = {}
        for extra in ("torch", "trl"):
            for req in map(Requirement, extras[extra]):
                if req.name != "treepack":
                    declared[req.name] = str(req.specifier)
        self.assertEqual(set(declared), {"torch", "transformers", "trl"})
        self.assertIn("treepack[torch]", extras["trl"])
        for package, spec in SUPPORTED.items():
            self.assertEqual(sorted(declared[package].split(",")), sorted(spec.split(",")), package)
        files = {**requirement_lines("requirements-torch.txt"), **requirement_lines("requirements-integrations.txt")}
        fla = requirement_lines("requirements-fla.txt")
        for package, spec in declared.items():
            self.assertEqual(sorted(files[package].split(",")), sorted(spec.split(",")), package)
            if package in fla:
                self.assertEqual(sorted(fla[package].split(",")), sorted(spec.split(",")), package)
        oldest = requirement_lines("requirements-oldest.txt")
        self.assertEqual(set(oldest), set(declared))
        for package, spec in declared.items():
            lower = next(s.version for s in Requirement(f"{package}{spec}").specifier if s.operator == ">=")
            self.assertTrue(any(s.operator == "<" for s in Requirement(f"{package}{spec}").specifier), f"{package} has no upper bound")
            self.assertEqual(Version(oldest[package].removeprefix("==")), Version(lower), package)

    def test_the_installed_versions_pass(self):
        require("transformers")
        if importlib.util.find_spec("trl"):
            require("trl")

    def test_a_version_outside_the_range_is_refused_naming_it_and_the_range(self):
        cases = {
            "transformers": (["5.16.2", "5.19.0", "5.19.0.dev0", "6.0.0", "4.57.6"], ["5.17.0", "5.18.0", "5.18.7", "5.18.0.dev0"]),
            "trl": (["1.12.1", "1.14.0", "2.0.0"], ["1.13.0", "1.13.4"]),
        }
        for package, (refused, accepted) in cases.items():
            for version in refused:
                with self.subTest(package=package, version=version), mock.patch.dict(os.environ, {ALLOW_ENV: ""}):
                    with self.assertRaises(TreepackError) as e:
                        check_version(package, version)
                    self.assertEqual((e.exception.code, e.exception.field), ("E_BACKEND", package))
                    self.assertIn(f"{package} {version} is outside", str(e.exception))
                    self.assertIn(SUPPORTED[package], str(e.exception))
                    self.assertIn(f"{ALLOW_ENV}=1", str(e.exception))
            for version in accepted:
                with self.subTest(package=package, version=version):
                    check_version(package, version)

    def test_the_environment_variable_lets_one_run_with_a_warning(self):
        with mock.patch.dict(os.environ, {ALLOW_ENV: "1"}), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            check_version("transformers", "5.77.1")
        self.assertEqual(len(seen), 1)
        self.assertIn("transformers 5.77.1 is outside", str(seen[0].message))
        with mock.patch.dict(os.environ, {ALLOW_ENV: ""}), self.assertRaises(TreepackError):
            check_version("transformers", "5.77.1")  # unset again: refused again


@needs_torch(transformers=True)
class PatchLayerRefuses(unittest.TestCase):
    def setUp(self):
        self.batch = tpt.load_microbatch(pack([[5, 6, 7, 8, 9], [5, 6, 7, 10]]))
        self.tree = tiny_model("qwen3", torch.float32)
        self.dense = tiny_model("qwen3", torch.float32, attn="sdpa")
        unset = mock.patch.dict(os.environ, {ALLOW_ENV: ""})
        unset.start()
        self.addCleanup(unset.stop)

    @staticmethod
    def running(package: str):
        """The module treepack reads the version of: sys.modules' (transformers' lazy module replaces itself there
        once models are built, so a name bound by an earlier ``import`` may be another object)."""
        return importlib.import_module(package)

    def test_every_entry_that_runs_a_model_on_a_tree_refuses_an_unknown_transformers(self):
        b = self.batch
        entries = {
            "prepare": lambda: tpt.prepare(self.tree),
            "packed_logprobs (treepack)": lambda: tpt.packed_logprobs(self.tree, b),
            "packed_logprobs (sdpa)": lambda: tpt.packed_logprobs(self.dense, b),
            "forward_logprobs": lambda: tpt.forward_logprobs(self.tree, b),
            "the attention function": lambda: self.tree(
                b.input_ids[None], position_ids=b.position_ids[None], attention_mask=tpt.tree_mask(b)
            ),
        }
        with mock.patch.object(self.running("transformers"), "__version__", "5.99.0"):
            for name, run in entries.items():
                with self.subTest(entry=name):
                    with self.assertRaises(TreepackError) as e:
                        run()
                    self.assertEqual(e.exception.field, "transformers")
                    self.assertIn("transformers 5.99.0 is outside", str(e.exception))
        for name, run in entries.items():  # the installed version runs them all
            with self.subTest(entry=name, version="installed"):
                run()

    @unittest.skipIf(importlib.util.find_spec("trl") is None, "trl not importable")
    def test_the_trl_integration_refuses_an_unknown_trl_at_import(self):
        name = "treepack.integrations.trl"
        loaded = sys.modules.pop(name, None)
        try:
            for package in ("trl", "transformers"):
                with self.subTest(package=package), mock.patch.object(self.running(package), "__version__", "9.0.0"):
                    with self.assertRaises(TreepackError) as e:
                        importlib.import_module(name)
                    self.assertEqual(e.exception.field, package)
                    self.assertIn(f"{package} 9.0.0 is outside", str(e.exception))
                    self.assertNotIn(name, sys.modules)
            self.assertTrue(hasattr(importlib.import_module(name), "TreepackGRPOTrainer"))  # the installed versions import
        finally:
            if loaded is not None:
                sys.modules[name] = loaded


if __name__ == "__main__":
    unittest.main()
