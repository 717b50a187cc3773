"""Builds a C++ CPU kernel file into a torch extension on first use (cached under
`build_root()`, rebuilt when a source, a header or the CPU changes), or reports why it cannot."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import threading
import time
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
                _built[name] = _load_or_build(name, source)
            except Exception as exc:  # the torch path still works
                unavailable[name] = _reason(exc)
                build_errors[name] = str(exc)
                log.warning("CPU kernel %s unavailable (%s); using the slower plain-torch path", name,
                            unavailable[name])
        return _built[name]


STALE_LOCK_S = 900.0  # a build lock older than this was left by a process that died while holding it


def _load_or_build(name: str, source: str) -> ModuleType:
    """The module built by an earlier process when its stamp says the same source, headers and
    flags, without going through torch's build (which takes a lock file in the build folder: a
    process killed while holding it, e.g. a worker stopped during start-up, would leave every
    later one waiting on it); otherwise torch builds it and the stamp is written."""
    from torch.utils.cpp_extension import load as build

    build_dir = os.path.join(build_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    module_name, path = f"radixmesh_{name}", os.path.join(CPU_DIR, source)
    flags = [*CFLAGS, *cpu_isa.compile_flags(), f"-DRADIXMESH_HEADERS={_headers_digest()}"]
    stamp, library = os.path.join(build_dir, "radixmesh.stamp"), os.path.join(build_dir, f"{module_name}.so")
    wanted = _stamp(path, flags)
    if os.path.exists(library) and _read(stamp) == wanted:
        return _import_library(module_name, library)
    _remove_stale_lock(os.path.join(build_dir, "lock"))
    module = build(module_name, [path], extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=build_dir,
                   verbose=False)
    with open(stamp, "w") as f:
        f.write(wanted)
    return module


def _stamp(source_path: str, flags: list[str]) -> str:
    with open(source_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return f"{digest} {' '.join(flags)}"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _import_library(module_name: str, library: str) -> ModuleType:
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_stale_lock(lock: str) -> None:
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock", extra={"lock": lock, "age_s": round(age)})
        try:
            os.remove(lock)
        except OSError:
            pass
