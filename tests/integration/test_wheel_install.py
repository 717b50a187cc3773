"""A non-editable install ships what its kernels need: build the wheel, install it into a
fresh virtual environment, and compile and run kernels from there (not the checkout): the
fewest kernels whose sources include, between them, every header (the wheel carries every
source, checked first), so that a missing header fails the build without compiling all seven.

The fresh venv borrows the project's installed dependencies (torch is 200 MB) through a
.pth path line, which adds their folder to sys.path without running that folder's own
.pth files, so the checkout's editable install is not visible in it.
"""
from __future__ import annotations

import glob
import inspect
import os
import re
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
names = sys.argv[1:]
assert build_all.main(names) == 0
for name in names:
    title, module = build_all.KERNELS[name]
    assert module.load() is not None, (title, cpu_build.unavailable)
print("BUILD_ROOT", cpu_build.build_root())
"""
CPU_DIR = os.path.join(ROOT, "kernels", "cpu")


def _included(name: str, seen: set[str] | None = None) -> set[str]:
    """The project headers a kernels/cpu file includes, transitively."""
    seen = set() if seen is None else seen
    with open(os.path.join(CPU_DIR, name)) as f:
        for header in re.findall(r'^#include "([^"]+)"', f.read(), re.M):
            if header not in seen:
                seen.add(header)
                _included(header, seen)
    return seen


def kernels_covering_every_header() -> list[str]:
    """build_all's kernel names, fewest first by greed, whose sources include every header."""
    from kernels import build_all
    sources = {name: re.search(r'load_cpu_extension\("[^"]+", "([^"]+)"\)', inspect.getsource(module)).group(1)
               for name, (_, module) in build_all.KERNELS.items()}
    headers = {os.path.basename(p) for p in glob.glob(os.path.join(CPU_DIR, "*.h"))}
    covers = {name: _included(source) for name, source in sources.items()}
    chosen: list[str] = []
    while missing := headers - set().union(*(covers[n] for n in chosen)):
        best = max(covers, key=lambda n: len(covers[n] & missing))
        assert covers[best] & missing, f"no kernel includes {sorted(missing)}"
        chosen.append(best)
    return chosen


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
    chosen = kernels_covering_every_header()
    run = subprocess.run([str(python), "-c", CHECK, *chosen], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=CHECK_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED" not in run.stdout
    build_root = run.stdout.split("BUILD_ROOT", 1)[1].strip()
    assert build_root.startswith(str(home / ".cache" / "radixmesh" / "kernels"))
    assert glob.glob(os.path.join(build_root, "*", "radixmesh_*.so"))
