"""The C++ CPU kernels a test needs: built, or the test fails (issue 32).

`make setup` builds every kernel and stops when one fails, so on a machine with a C++ compiler
a missing kernel is a broken build, never a reason to skip: `built(module)` fails the test,
naming the kernel and the compiler's verdict. Only a machine with no compiler skips."""
from __future__ import annotations

import shutil
from types import ModuleType

import pytest

from kernels import cpu_build


def built(kernel: ModuleType) -> ModuleType:
    """kernel.load(), the compiled extension; fails (or, with no C++ compiler, skips) when it is missing."""
    module = kernel.load()
    if module is not None:
        return module
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(f"no C++ compiler to build {kernel.__name__}", allow_module_level=True)
    pytest.fail(f"{kernel.__name__} did not build on a machine with a C++ compiler: "
                f"{cpu_build.unavailable or 'no reason recorded'} (run `python -m kernels.build_all`)", pytrace=False)
