"""Builds a C++ CPU kernel file into a torch extension on first use (cached by
torch under ~/.cache/torch_extensions), or reports that it cannot."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import threading
from types import ModuleType

log = logging.getLogger(__name__)
_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}
CPU_DIR = os.path.join(os.path.dirname(__file__), "cpu")
# Each checkout builds into its own folder (torch's shared ~/.cache/torch_extensions would make
# two checkouts rebuild over each other); RADIXMESH_KERNEL_BUILD_DIR moves it.
BUILD_DIR = os.environ.get("RADIXMESH_KERNEL_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".build", "kernels")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def _headers_digest() -> str:
    """torch rebuilds when a source or a flag changes, not a header: make the headers a flag."""
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(CPU_DIR, "*.h"))):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def load_cpu_extension(name: str, source: str) -> ModuleType | None:
    """The compiled module `radixmesh_<name>` of kernels/cpu/<source>, or None when
    it cannot be built here (no compiler or headers; logged once) — callers fall back to torch."""
    with _lock:
        if name not in _built:
            _built[name] = None
            try:
                from torch.utils.cpp_extension import load as build
                build_dir = os.path.join(BUILD_DIR, name)
                os.makedirs(build_dir, exist_ok=True)
                _built[name] = build(f"radixmesh_{name}", [os.path.join(CPU_DIR, source)],
                                     extra_cflags=[*CFLAGS, f"-DRADIXMESH_HEADERS={_headers_digest()}"],
                                     extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
            except Exception as exc:  # the torch path still works
                log.warning("CPU kernel %s unavailable (%s); using plain torch", name, exc)
        return _built[name]
