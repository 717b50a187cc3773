"""The import contracts of pyproject.toml's [tool.importlinter] hold: the scheduler and
the worker share services/step and never import each other, kernels import no service,
the front stages import no back stage, the shared layer (services/step, services/common)
imports no stage, radixmesh.lang (a client) imports no service. On a break, the failure is lint-imports' report: the contract and the
import chain that breaks it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")  # import-linter, a test extra
ROOTS = ("services", "kernels", "radixmesh")  # [tool.importlinter] root_packages


def lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports over the packages under `tree` (it puts its cwd first on sys.path)."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} missing: pip install -e '.[test]'"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold() -> None:
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_forbidden_import_breaks_them(tmp_path: Path) -> None:
    """The contracts bite: the same tree with a worker module importing the scheduler fails."""
    for root in ROOTS:
        shutil.copytree(REPO / root, tmp_path / root, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "services" / "worker" / "_forbidden.py").write_text("from services.scheduler import config\n")
    proc = lint(tmp_path)
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0, report
    assert "services.worker._forbidden -> services.scheduler.config" in report, report


def test_the_frontend_language_may_not_import_a_service(tmp_path: Path) -> None:
    """radixmesh.lang talks to a server only over the wire: importing services breaks the contract
    (its gRPC backend imports the generated protos, which are no root package: outside the contracts)."""
    for root in ROOTS:
        shutil.copytree(REPO / root, tmp_path / root, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "radixmesh" / "lang" / "_forbidden.py").write_text("from services.gateway import errors\n")
    proc = lint(tmp_path)
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0, report
    assert "radixmesh.lang._forbidden -> services.gateway.errors" in report, report
