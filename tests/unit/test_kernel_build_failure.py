"""A kernel that fails to build fails `make setup`, with the compiler's message (issue 32):
a copy of the Makefile and kernels/ with one source broken, set up against this checkout's
virtual environment, building only that kernel into a scratch folder."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow  # a real compile, ~20 s

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".venv")
BROKEN = "#error radixmesh test: a forced build failure\n"


@pytest.mark.skipif(not os.path.exists(os.path.join(VENV, ".installed")), reason="needs `make setup`'s .venv")
def test_a_broken_kernel_source_fails_make_setup_with_the_compilers_message(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(os.path.join(ROOT, name), tmp_path / name)  # mtimes kept: the venv's stamp stays newer
    shutil.copytree(os.path.join(ROOT, "kernels"), tmp_path / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "kernels" / "cpu" / "token_bitmask.cpp"
    source.write_text(BROKEN + source.read_text())
    env = {**os.environ, "RADIXMESH_KERNEL_BUILD_DIR": str(tmp_path / "build")}
    env.pop("PYTHONPATH", None)  # the copy's kernels/, not the checkout's
    run = subprocess.run(["make", "--no-print-directory", "setup", f"VENV={VENV}", "KERNELS=token_bitmask"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "grammar token bitmask: FAILED" in out, out[-3000:]
    assert "a forced build failure" in out, out[-3000:]  # the compiler's own message reaches the user
    assert str(tmp_path / "kernels" / "cpu") in out  # the copy was built, not the checkout
