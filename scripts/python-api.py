"""Prints docs/reference/python.md: the public API of the treepack Python package, from its docstrings and
signatures (scripts/gen-docs.ts runs it with PYTHONPATH=python; pdoc and sphinx are not needed).

Public names are a module's ``__all__``, else what it defines without a leading underscore. Every public function,
class and method must have a docstring: one without makes this script fail, naming it."""

from __future__ import annotations

import importlib
import inspect
import re
import sys

MODULES = ("treepack", "treepack.balance", "treepack.torch", "treepack.client", "treepack.integrations.trl", "treepack.versions")
missing: list[str] = []


def public_names(mod) -> list[str]:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, v in vars(mod).items() if not n.startswith("_") and getattr(v, "__module__", None) == mod.__name__]
    return sorted(names, key=lambda n: (not inspect.isclass(getattr(mod, n)), n.lower()))


def signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    # Defaults that print an object's address would change at every run.
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def doc(obj, qualname: str) -> str:
    d = inspect.getdoc(obj)
    # A dataclass or namedtuple without a docstring gets its signature as one: that documents nothing.
    if not d or d.startswith(qualname.rsplit(".", 1)[-1] + "("):
        missing.append(qualname)
        return ""
    return d.strip()


def block(text: str) -> list[str]:
    # Docstrings are prose with doctest examples, fenced as `pycon` (an example runs until a blank line): the docs
    # tests leave them to python/tests/test_doctests.py, which runs every one against its fixtures.
    out: list[str] = []
    fence = False
    indent = 0
    for line in text.splitlines():
        if line.lstrip().startswith(">>>") and not fence:
            out.append("```pycon")
            fence = True
            indent = len(line) - len(line.lstrip())
        elif fence and line.strip() == "":
            out.append("```")
            fence = False
        out.append(line[indent:] if fence else line)
    if fence:
        out.append("```")
    return out + [""]


def own_members(cls) -> list[tuple[str, object]]:
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            members.append((name, value))
    return sorted(members, key=lambda m: m[0])


def render_class(modname: str, name: str, cls) -> list[str]:
    q = f"{modname}.{name}"
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    out = [f"### class `{name}`", "", "```text", f"{name}{signature(cls)}" + (f"  # bases: {', '.join(bases)}" if bases else ""), "```", ""]
    out += block(doc(cls, q))
    for mname, m in own_members(cls):
        if isinstance(m, property):
            out += [f"- **`{mname}`** (property): " + (inspect.getdoc(m) or missing.append(f"{q}.{mname}") or "").replace("\n", " ")]
        else:
            d = doc(m, f"{q}.{mname}")
            out += [f"- **`{mname}{signature(m)}`**" + (": " + d.replace("\n", " ") if d else "")]
    return out + [""]


def render_function(modname: str, name: str, fn) -> list[str]:
    return [f"### `{name}`", "", "```text", f"{name}{signature(fn)}", "```", ""] + block(doc(fn, f"{modname}.{name}"))


def render_value(name: str, value) -> list[str]:
    text = repr(value)
    if len(text) > 200:
        text = f"<{type(value).__name__} of {len(value)} items>" if hasattr(value, "__len__") else f"<{type(value).__name__}>"
    return [f"- **`{name}`** = `{text}`"]


def main() -> int:
    out = ["# Python API", ""]
    out += [
        "The trainer side, `pip install ./python` (numpy only; `treepack.torch` and the integrations need torch,",
        "transformers and, for TRL, trl). Generated from the package's docstrings and signatures; the modules are",
        "`" + "`, `".join(MODULES) + "`. Errors are `treepack.TreepackError` (see [errors.md](errors.md)).",
        "",
        "The `pycon` examples are doctests, run by the test suite (python/tests/test_doctests.py) in a directory",
        "holding `packed/` and `planned/` (`treepack pack` output of four pre-tokenized samples: a and b share",
        "`[2, 3, 4, 5]`, c and d share `[2, 3, 10]`), `tiny-model/` (a tiny random Qwen3 with a word-level tokenizer,",
        "vocabulary 64) and, for `treepack.client`, `url`: a `treepack serve` holding one finished group.",
        "",
    ]
    for modname in MODULES:
        mod = importlib.import_module(modname)
        out += [f"## `{modname}`", ""] + block(doc(mod, modname))
        values = []
        for name in public_names(mod):
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                out += render_class(modname, name, obj)
            elif callable(obj):
                out += render_function(modname, name, obj)
            else:
                values += render_value(name, obj)
        if values:
            out += ["### Constants", ""] + values + [""]
    if missing:
        print("public names without a docstring: " + ", ".join(missing), file=sys.stderr)
        return 1
    sys.stdout.write("\n".join(out).rstrip("\n") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
