"""treepack's C libraries through ctypes: where they are found, and each C function given its signature from
_abi.py (read from the C headers by scripts/gen-abi.ts, with typed pointers: pass ``pointer(array)``).

CPU core, ``libtreepack_core.so`` (required by packing, the checks, the mask lowerings and the CPU loss), the first of:

1. ``TREEPACK_CORE_LIB`` when set (then the only candidate: an explicit path never silently falls back);
2. inside the installed package (``pip install ./python`` compiles it there);
3. a checkout's build directories, for development with ``PYTHONPATH=python``: ``build/Release`` (``npm install``),
   ``build-cmake/Release`` and ``build-cmake`` (``npm run build:cuda``).

CUDA library, ``libtreepack_cuda.so`` (optional, never in the wheel): ``TREEPACK_CUDA_LIB`` when set, else the
checkout's ``build-cmake``. ``cuda_status()`` says why it is not loaded without raising.

A library built from other ABI tables than this package's (``_abi.ABI``) is refused; the error names every path
tried and why each failed.

    >>> from treepack import _native
    >>> _native.core().tp_version()
    b'0.1.0'
    >>> status = _native.cuda_status()   # '' when loaded, else the reason
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import numpy as np

from . import _abi
from .errors import TreepackError

CORE = "libtreepack_core.so"
CUDA = "libtreepack_cuda.so"

_HERE = os.path.dirname(os.path.abspath(__file__))
# python/treepack → the checkout's root; an installed package has no native/ two levels up.
_CHECKOUT = os.path.normpath(os.path.join(_HERE, "..", ".."))

# Every struct and function signature is read from the C headers by scripts/gen-abi.ts (_abi.py): pointers are typed,
# so ctypes refuses an array of the wrong element type (pass pointer(a), never a bare address).
Violation = _abi.tp_violation
_Signatures = dict[str, tuple[Optional[type], list[type]]]  # a runtime alias: no `X | None` on Python 3.9
_C_TYPES = {
    np.dtype(t): c
    for t, c in (
        (np.int32, ctypes.c_int32),
        (np.int64, ctypes.c_int64),
        (np.uint8, ctypes.c_uint8),
        (np.uint32, ctypes.c_uint32),
        (np.float32, ctypes.c_float),
        (np.float64, ctypes.c_double),
    )
}


def _candidates(env: str, name: str, in_package: bool) -> list[str]:
    if os.environ.get(env):
        return [os.environ[env]]
    paths = [os.path.join(_HERE, name)] if in_package else []
    if os.path.isdir(os.path.join(_CHECKOUT, "native", "core")):
        dirs = ("build/Release", "build-cmake/Release", "build-cmake") if name == CORE else ("build-cmake/Release", "build-cmake")
        paths += [os.path.join(_CHECKOUT, *d.split("/"), name) for d in dirs]
    return paths


def _open(env: str, name: str, abi_fn: str, signatures: _Signatures, hint: str, in_package: bool) -> ctypes.CDLL:
    errors = []
    for path in _candidates(env, name, in_package):
        if not os.path.exists(path):
            errors.append(f"{path}: not found")
            continue
        try:
            lib = ctypes.CDLL(os.path.abspath(path))
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        fingerprint = getattr(lib, abi_fn, None)
        if fingerprint is None:
            errors.append(f"{path}: no ABI fingerprint (built by an older treepack; rebuild it)")
            continue
        fingerprint.restype = ctypes.c_char_p
        abi = fingerprint().decode()
        if abi != _abi.ABI:
            errors.append(f"{path}: built from other ABI tables ({abi}, this package has {_abi.ABI}; rebuild it)")
            continue
        missing = [fn for fn in signatures if getattr(lib, fn, None) is None]
        if missing:
            errors.append(f"{path}: lacks {', '.join(missing)} (rebuild it)")
            continue
        for fn, (restype, argtypes) in signatures.items():
            f = getattr(lib, fn)
            f.restype, f.argtypes = restype, argtypes
        return lib
    tried = f"tried {'; '.join(errors)}" if errors else f"{env} is not set and this package is not in a checkout's python/"
    raise TreepackError("E_BACKEND", f"{name} not loaded ({tried}); {hint} or set {env}", field=env)


_core: ctypes.CDLL | None = None
_cuda: ctypes.CDLL | None = None
_cuda_error: TreepackError | None = None


def core() -> ctypes.CDLL:
    """The CPU core; TreepackError E_BACKEND naming every path tried when none loads."""
    global _core
    if _core is None:
        hint = "reinstall treepack (`pip install ./python` compiles it), or in a checkout build it with `npm install`"
        _core = _open("TREEPACK_CORE_LIB", CORE, "tp_abi", _abi.CORE_FUNCTIONS, hint, in_package=True)
    return _core


def cuda() -> ctypes.CDLL:
    """The CUDA library; TreepackError E_BACKEND (with the paths tried) when it is not built or not found."""
    global _cuda, _cuda_error
    if _cuda is None:
        if _cuda_error is not None:
            raise _cuda_error
        try:
            _cuda = _open(
                "TREEPACK_CUDA_LIB",
                CUDA,
                "tp_cuda_abi",
                _abi.CUDA_FUNCTIONS,
                "build it in a checkout with `npm run build:cuda` (needs nvcc)",
                in_package=False,
            )
        except TreepackError as e:
            _cuda_error = e
            raise
    return _cuda


def cuda_status() -> str:
    """'' when the CUDA library loads, else why not (never raises: CUDA is optional)."""
    try:
        cuda()
        return ""
    except TreepackError as e:
        return e.reason


def status_message(code: int) -> str:
    """The name and message of a status of the C ABIs (the CPU and CUDA libraries share them)."""
    if 0 <= code < len(_abi.STATUSES):
        name, message, _ = _abi.STATUSES[code]
        return f"{name}: {message}"
    return f"unknown treepack status {code}"


def check(rc: int, what: str, field: str) -> None:
    """Raises the TreepackError of a failed call (status rc) of ``what``, naming ``field``."""
    if rc != _abi.TP_OK:
        code = _abi.STATUSES[rc][2] if 0 < rc < len(_abi.STATUSES) else "E_BACKEND"
        raise TreepackError(code, f"{what}: {status_message(rc)}", field=field)


def pointer(a: np.ndarray | None) -> Any:
    """A contiguous numpy array as a pointer to its element type (NULL for None); ctypes checks it against the
    argument's type, so an int64 array given for an ``int32_t*`` is an error, not a misread."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise ValueError("expected a C-contiguous array")
    return a.ctypes.data_as(ctypes.POINTER(_C_TYPES[a.dtype]))


def device_pointer(address: int | None, ctype: Any) -> Any:
    """A device (or any foreign) address, such as a torch tensor's ``data_ptr()``, as a ``ctype*`` (NULL for None)."""
    return None if address is None else ctypes.cast(address, ctypes.POINTER(ctype))
