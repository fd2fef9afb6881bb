"""Every ``>>>`` example in python/treepack's docstrings runs as a doctest (docs/reference/python.md shows them as
``pycon`` blocks): one test per module that has examples, failing with doctest's report when an example raises or prints other than
its expected output. Options for every example: ELLIPSIS and NORMALIZE_WHITESPACE.

The examples run in a temporary working directory holding these fixtures, made once:

- ``packed/``: ``treepack pack samples.jsonl --out packed/ --vocab-size 64 --max-tokens 16 --dp 2 --masks
  block:128,slices`` (the CLI of this checkout) on the four pre-tokenized samples of docs/guides/pytorch.md with
  rollout logprobs (``old_logprobs``) added, ``SAMPLES`` here: micro-batch 0 (rank 0) holds samples a and b, which
  share ``[2, 3, 4, 5]`` (10 nodes); micro-batch 1 (rank 1) holds c and d, which share ``[2, 3, 10]`` (8 nodes).
- ``planned/``: the same samples packed as one rank's step plan, ``--max-tokens 8 --prefix-reuse 64``: both
  micro-batches hang from the cached prefix ``[2, 3]``.
- ``tiny-model/``: a 2-layer random-weight Qwen3 with vocabulary 64 and its tokenizer (word level: ``<pad>`` 0,
  ``<eos>`` 1, ``w2`` ... ``w63``), saved by ``save_pretrained``, for the torch and TRL examples; made only where
  torch and transformers import.
- ``url``, for treepack.client's examples: a ``treepack serve --tokenizer qwen3`` on a free loopback port, its data
  in the working directory, holding one finished group (slime buffer writes: instance 0, two answers to "2+2?").
  Its engine is never called (the URL is a closed port).

A module whose examples need torch (and transformers, or trl and datasets: ``needs``) skips with the reason where
one is not installed, and fails instead under TREEPACK_REQUIRE_TORCH=1. No example is skipped otherwise. A check
that the examples found equal the ``>>>`` lines of the sources keeps an example from escaping the runner (in a place doctest does not look).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request

import treepack

PACKAGE = os.path.dirname(os.path.abspath(treepack.__file__))
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
SAMPLES = "".join(
    json.dumps(r) + "\n"
    for r in [
        {
            "id": "a",
            "group": "g1",
            "reward": 1,
            "tokens": [2, 3, 4, 5, 6, 7, 1],
            "loss_mask": [0, 0, 0, 0, 1, 1, 1],
            "old_logprobs": [0, 0, 0, 0, -4.2, -4.0, -4.2],
        },
        {
            "id": "b",
            "group": "g1",
            "reward": 0,
            "tokens": [2, 3, 4, 5, 8, 9, 1],
            "loss_mask": [0, 0, 0, 0, 1, 1, 1],
            "old_logprobs": [0, 0, 0, 0, -4.2, -4.1, -4.1],
        },
        {
            "id": "c",
            "group": "g2",
            "reward": 1,
            "tokens": [2, 3, 10, 11, 12, 1],
            "loss_mask": [0, 0, 0, 1, 1, 1],
            "old_logprobs": [0, 0, 0, -4.1, -4.2, -4.0],
        },
        {
            "id": "d",
            "group": "g2",
            "reward": 0,
            "tokens": [2, 3, 10, 13, 1],
            "loss_mask": [0, 0, 0, 1, 1],
            "old_logprobs": [0, 0, 0, -4.1, -4.2],
        },
    ]
)
PACKS = {
    "packed": ["--max-tokens", "16", "--dp", "2", "--masks", "block:128,slices"],
    "planned": ["--max-tokens", "8", "--prefix-reuse", "64"],
}


def module_names() -> list[str]:
    """Every module of the installed package, from its files (importing them to walk would need torch)."""
    names = []
    for d, _, files in os.walk(PACKAGE):
        rel = os.path.relpath(d, os.path.dirname(PACKAGE)).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                names.append(rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
    return sorted(names)


def needs(name: str) -> tuple[str, ...]:
    """The optional packages a module's examples import (torch's and TRL's load tiny-model with transformers)."""
    if name.startswith("treepack.integrations"):
        return ("torch", "transformers", "trl", "datasets")
    if name.startswith("treepack.torch"):
        return ("torch", "transformers")
    if name == "treepack.versions":
        return ("packaging",)  # installed with transformers, whose versions it checks
    return ("torch",) if name in ("treepack.flex", "treepack.client") else ()


def source_examples(name: str) -> int:
    """The ``>>>`` prompts in a module's source: what its docstrings' examples must add up to."""
    path = os.path.join(os.path.dirname(PACKAGE), *name.split("."))
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if re.match(r"\s*>>>", line))


_fixtures: dict = {}


def cli() -> list[str]:
    path = os.path.join(CHECKOUT, "dist", "src", "cli", "main.js")
    if not os.path.exists(path) or shutil.which("node") is None:
        raise RuntimeError(f"the doctests' fixtures need node and {path} (npx tsc -p tsconfig.json)")
    return ["node", path]


def workdir(model: bool) -> str:
    """The temporary working directory with ``packed/``, ``planned/`` and, when ``model``, ``tiny-model/``."""
    if "dir" not in _fixtures:
        d = _fixtures["dir"] = tempfile.mkdtemp(prefix="treepack-doctest-")
        with open(os.path.join(d, "samples.jsonl"), "w") as f:
            f.write(SAMPLES)
        for out, options in PACKS.items():
            args = cli() + ["pack", "samples.jsonl", "--out", out + "/", "--vocab-size", "64", *options]
            r = subprocess.run(args, cwd=d, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr}")
    if model and "model" not in _fixtures:
        import torch
        import transformers
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

        transformers.utils.logging.disable_progress_bar()  # loading tiny-model in the examples would draw one each time
        path = os.path.join(_fixtures["dir"], "tiny-model")
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
        )
        Qwen3ForCausalLM(config).save_pretrained(path)
        words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 64)}}, unk_token="<pad>"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>").save_pretrained(path)
        _fixtures["model"] = path
    return _fixtures["dir"]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as res:
        return json.loads(res.read())


def service() -> str:
    """The ``url`` fixture: a treepack serve with one finished group waiting for the trainer (module docstring)."""
    if "url" not in _fixtures:
        with socket.socket() as s:  # a free port: serve takes no --port 0
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = cli() + ["serve", "--engine", "http://127.0.0.1:9/v1", "--data", "serve-log/", "--tokenizer", "qwen3", "--port", str(port)]
        log = _fixtures["serve.log"] = open(os.path.join(workdir(model=False), "serve.log"), "w")
        _fixtures["serve"] = subprocess.Popen(args, cwd=workdir(model=False), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=5).close()
                break
            except OSError:
                if _fixtures["serve"].poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    with open(log.name) as f:
                        raise RuntimeError(f"{' '.join(args)} did not come up: {f.read()[-2000:]}") from None
                time.sleep(0.1)
        post(url + "/start_rollout", {"num_repeat_per_sample": 2})
        for uid, answer in enumerate(["3", "4"]):
            post(
                url + "/buffer/write",
                {
                    "uid": uid,
                    "instance_id": 0,
                    "reward": uid,
                    "extra_info": {},
                    "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}],
                },
            )
        _fixtures["url"] = url
    return _fixtures["url"]


def tearDownModule() -> None:
    if "serve" in _fixtures:
        _fixtures["serve"].terminate()
        _fixtures["serve"].wait(timeout=30)
        _fixtures["serve.log"].close()
    if "dir" in _fixtures:
        shutil.rmtree(_fixtures["dir"], ignore_errors=True)
    _fixtures.clear()


def skip_unless_installed(test: unittest.TestCase, name: str) -> None:
    """Skips the test, saying why, where a package the module's examples need is not installed (an installed one
    that fails to import is a failure, not a skip)."""
    absent = [dep for dep in needs(name) if importlib.util.find_spec(dep) is None]
    if absent:
        reason = f"the examples of {name} need {', '.join(absent)}, not installed"
        if os.environ.get("TREEPACK_REQUIRE_TORCH") == "1":
            raise RuntimeError(f"TREEPACK_REQUIRE_TORCH=1 but {reason}")
        test.skipTest(reason)


class Doctests(unittest.TestCase):
    def run_module(self, name: str) -> None:
        expected = source_examples(name)
        skip_unless_installed(self, name)
        mod = importlib.import_module(name)
        globs = {"url": service()} if name == "treepack.client" else None
        tests = [t for t in doctest.DocTestFinder().find(mod, name, extraglobs=globs) if t.examples]
        self.assertEqual(sum(len(t.examples) for t in tests), expected, f"{name}: examples doctest finds vs >>> lines in its source")
        cwd = os.getcwd()
        os.chdir(workdir(model="transformers" in needs(name)))
        try:
            report: list[str] = []
            runner = doctest.DocTestRunner(optionflags=OPTIONS)
            for t in tests:
                runner.run(t, out=report.append)
        finally:
            os.chdir(cwd)
        self.assertEqual(runner.failures, 0, "".join(report))


def _add(name: str) -> None:
    setattr(Doctests, "test_" + name.replace(".", "_"), lambda self: self.run_module(name))


for _name in module_names():
    if source_examples(_name):
        _add(_name)


if __name__ == "__main__":
    unittest.main()
