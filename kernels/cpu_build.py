"""Builds a C++ CPU kernel file into a torch extension on first use (cached under
`build_root()`, rebuilt when a source, a header or the CPU changes), or reports why it cannot."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import threading
from types import ModuleType

from kernels import cpu_isa

log = logging.getLogger(__name__)
_locks: dict[str, threading.Lock] = {}  # one per kernel: several kernels may build at once
_locks_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}
unavailable: dict[str, str] = {}  # kernel name -> why it could not be built (for the worker's start-up log)
build_errors: dict[str, str] = {}  # kernel name -> the build's whole error text (the compiler's messages)
CPU_DIR = os.path.join(os.path.dirname(__file__), "cpu")
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]  # plus kernels.cpu_isa.compile_flags(): -march, the CPU's flags


def build_root() -> str:
    """Where compiled kernels go. A checkout builds into its own .build/kernels (torch's shared
    ~/.cache/torch_extensions would make two checkouts rebuild over each other); an installed
    package, whose folder may not be writable, into ~/.cache/radixmesh/kernels.
    RADIXMESH_KERNEL_BUILD_DIR moves it. One subfolder per RADIXMESH_CPU_ISA choice."""
    root = os.environ.get("RADIXMESH_KERNEL_BUILD_DIR")
    if not root:
        project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        in_checkout = os.path.exists(os.path.join(project, "pyproject.toml"))
        root = (os.path.join(project, ".build", "kernels") if in_checkout else
                os.path.join(os.path.expanduser("~"), ".cache", "radixmesh", "kernels"))
    return os.path.join(root, cpu_isa.build_tag())


def _headers_digest() -> str:
    """torch rebuilds when a source or a flag changes, not a header: make the headers a flag."""
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(CPU_DIR, "*.h"))):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _reason(exc: Exception) -> str:
    """The last line of a build error (the compiler's or ninja's verdict), with its type."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"


def load_cpu_extension(name: str, source: str) -> ModuleType | None:
    """The compiled module `radixmesh_<name>` of kernels/cpu/<source>, or None when
    it cannot be built here (no compiler or headers; logged once) — callers fall back to torch."""
    with _locks_lock:
        lock = _locks.setdefault(name, threading.Lock())
    with lock:
        if name not in _built:
            _built[name] = None
            try:
                from torch.utils.cpp_extension import load as build
                build_dir = os.path.join(build_root(), name)
                os.makedirs(build_dir, exist_ok=True)
                flags = [*CFLAGS, *cpu_isa.compile_flags(), f"-DRADIXMESH_HEADERS={_headers_digest()}"]
                _built[name] = build(f"radixmesh_{name}", [os.path.join(CPU_DIR, source)], extra_cflags=flags,
                                     extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
            except Exception as exc:  # the torch path still works
                unavailable[name] = _reason(exc)
                build_errors[name] = str(exc)
                log.warning("CPU kernel %s unavailable (%s); using the slower plain-torch path", name,
                            unavailable[name])
        return _built[name]
