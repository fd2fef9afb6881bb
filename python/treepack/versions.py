"""The versions of the packages whose internals treepack's trainer side depends on, as CI tests them, and the check
that refuses any other: ``treepack.torch`` registers an attention function with transformers, patches the modeling
modules of hybrid models and reads how their forwards take a mask; ``treepack.integrations.trl`` overrides TRL's
private methods and reads its private state. A release outside these ranges may change any of that silently, so
it is refused (TreepackError E_BACKEND naming the installed version and the range) unless
``TREEPACK_ALLOW_UNTESTED_VERSIONS=1`` lets it run, at the user's risk, with a warning.

The ranges equal the extras in python/pyproject.toml (python/tests/trainer/test_versions.py holds them equal), and
CI runs the trainer suites on the oldest and on the newest version of each that the package index offers
(docs/guides/pytorch.md#tested-versions).

    >>> SUPPORTED["transformers"]
    '>=5.17,<5.19'
    >>> check_version("transformers", "5.99.0")
    Traceback (most recent call last):
    treepack.errors.TreepackError: field "transformers": transformers 5.99.0 is outside the versions treepack is tested with
    (transformers>=5.17,<5.19): install one of them (pip install 'treepack[torch]'), or set ...=1 to run it at your own risk
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

from .errors import TreepackError

# Package -> the PEP 440 range CI tests (python/pyproject.toml's extras say the same).
SUPPORTED = {
    "transformers": ">=5.17,<5.19",
    "trl": ">=1.13,<1.14",
}
# The extra that installs a supported version, for the message.
_EXTRA = {"transformers": "torch", "trl": "trl"}
ALLOW_ENV = "TREEPACK_ALLOW_UNTESTED_VERSIONS"


def require(package: str) -> None:
    """Refuses the installed ``package`` (a key of ``SUPPORTED``) when its ``__version__`` is outside its range."""
    check_version(package, str(importlib.import_module(package).__version__))


def check_version(package: str, installed: str) -> None:
    """Refuses ``installed`` (a version string of ``package``) outside ``SUPPORTED[package]`` with a TreepackError;
    with ``TREEPACK_ALLOW_UNTESTED_VERSIONS=1`` warns once instead."""
    if not _supported(package, installed):
        _refuse(package, installed, os.environ.get(ALLOW_ENV) == "1")


@functools.cache
def _supported(package: str, installed: str) -> bool:
    from packaging.specifiers import SpecifierSet  # a dependency of transformers and TRL, the packages checked

    # prereleases=True: a development build inside the range (5.18.0.dev0) is that release; one of the next is not.
    return SpecifierSet(SUPPORTED[package]).contains(installed, prereleases=True)


@functools.cache  # cached only when it returns: the warning is given once per version
def _refuse(package: str, installed: str, allowed: bool) -> None:
    message = (
        f"{package} {installed} is outside the versions treepack is tested with ({package}{SUPPORTED[package]}): "
        f"install one of them (pip install 'treepack[{_EXTRA[package]}]'), or set {ALLOW_ENV}=1 to run it at your own risk"
    )
    if not allowed:
        raise TreepackError("E_BACKEND", message, field=package)
    warnings.warn(f"{message}; running it because {ALLOW_ENV}=1", RuntimeWarning, stacklevel=4)
