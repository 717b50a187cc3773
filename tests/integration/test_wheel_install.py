"""A non-editable install ships what its kernels need: build the wheel, install it into a
fresh virtual environment, and compile and run the kernels from there (not the checkout).

The fresh venv borrows the project's installed dependencies (torch is 200 MB) through a
.pth path line, which adds their folder to sys.path without running that folder's own
.pth files, so the checkout's editable install is not visible in it.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = """
import os, sys
import kernels
from kernels import build_all, cpu_build
assert os.path.dirname(kernels.__file__).startswith(sys.prefix), kernels.__file__
assert build_all.main([]) == 0  # every kernel
for name, module in build_all.KERNELS.values():
    assert module.load() is not None, (name, cpu_build.unavailable)
print("BUILD_ROOT", cpu_build.build_root())
"""


# Inner timeouts stay below each test's own (pytest-timeout counts fixture setup too, and the
# module-scoped wheel is built in the setup of whichever test runs first).
WHEEL_S, INSTALL_S, CHECK_S = 600, 300, 1200


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), ROOT], check=True, cwd=ROOT, timeout=WHEEL_S)
    (path,) = glob.glob(str(out / "radixmesh-*.whl"))
    return path


@pytest.mark.timeout(WHEEL_S + 300)
def test_the_wheel_carries_every_kernel_source_and_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "kernels", "cpu", "*"))}
    assert sources and sources <= names, sorted(sources - names)
    assert any(n.startswith("protos/radixmesh/v1/") and n.endswith("_pb2.py") for n in names)


@pytest.mark.timeout(WHEEL_S + 60 + INSTALL_S + CHECK_S + 300)  # 2,460 s
def test_kernels_compile_and_load_in_a_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(site, "radixmesh_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # torch and friends, not the checkout
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", wheel], check=True, timeout=INSTALL_S)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RADIXMESH_KERNEL_BUILD_DIR")}
    env["HOME"] = str(home)  # an installed package builds under ~/.cache/radixmesh
    run = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=CHECK_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED" not in run.stdout
    build_root = run.stdout.split("BUILD_ROOT", 1)[1].strip()
    assert build_root.startswith(str(home / ".cache" / "radixmesh" / "kernels"))
    assert glob.glob(os.path.join(build_root, "*", "radixmesh_*.so"))
