"""The suite's memory, watched: the peak RSS of the pytest process and of its whole process
tree (the meshes' children included), sampled every half second, printed at the end of the run,
and checked against a budget, so a leak like issue 32's (engines piling up to 22 GB on a
24 GiB machine) fails `make test` instead of the machine.

Budgets, in GiB, from the environment: RADIXMESH_TEST_RSS_BUDGET_GIB for the pytest process
(default 10) and RADIXMESH_TEST_TREE_RSS_BUDGET_GIB for the tree (default 16); the AMD EPYC run of
2026-12-04 peaked at 6.97 and 7.14 GiB (docs/testing.md). A run over budget
ends with exit status 1 and says which module was running at the peak.
The end of a module that grew the pytest process by more than TRIM_AFTER_BYTES returns freed memory
to the OS (gc, then malloc_trim), as Engine.shutdown does; a trim costs ~0.1 s, so small modules skip it.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import psutil
import pytest

from services.common.host_memory import return_freed_memory

GIB = 1 << 30
INTERVAL_S = 0.5
TRIM_AFTER_BYTES = 256 << 20  # a module that grew the process by more than this gives its memory back


def tree_rss_bytes(root: psutil.Process) -> int:
    """RSS of root and every descendant (a child that exits meanwhile counts 0)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


@dataclass
class Peak:
    bytes: int = 0
    module: str = ""


class RssWatch:
    def __init__(self, self_budget: float, tree_budget: float):
        self.budgets = {"pytest process": self_budget, "process tree": tree_budget}
        self.peaks = {"pytest process": Peak(), "process tree": Peak()}
        self._module = "(collection)"
        self._module_start = 0  # the pytest process's RSS when the module began
        self._process = psutil.Process()
        self.module_peaks: dict[str, int] = {}  # the pytest process's peak while each module ran
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="rss-watch", daemon=True)

    @property
    def module(self) -> str:
        return self._module

    @module.setter
    def module(self, name: str) -> None:
        if name != self._module:
            self._module, self._module_start = name, self._process.memory_info().rss

    def grew_in_module(self) -> bool:
        """Whether the pytest process's peak in this module rose TRIM_AFTER_BYTES above where it began."""
        return self.module_peaks.get(self._module, 0) - self._module_start > TRIM_AFTER_BYTES

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def sample(self, tree: bool = True) -> None:
        """The pytest process's RSS, and with `tree` its whole tree's (a walk over /proc)."""
        own = self._process.memory_info().rss
        self.module_peaks[self.module] = max(own, self.module_peaks.get(self.module, 0))
        for name, value in (("pytest process", own), ("process tree", tree_rss_bytes(self._process) if tree else 0)):
            if value > self.peaks[name].bytes:
                self.peaks[name] = Peak(value, self.module)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self.sample()

    def report(self) -> tuple[list[str], bool]:
        """Lines to print, and whether every peak stayed within its budget."""
        lines, within = [], True
        for name, peak in self.peaks.items():
            budget = self.budgets[name]
            over = peak.bytes > budget * GIB
            within &= not over
            lines.append(f"peak RSS, {name}: {peak.bytes / GIB:.2f} GiB (budget {budget:g} GiB{', OVER' if over else ''})"
                         f" during {peak.module}")
        top = sorted(self.module_peaks.items(), key=lambda kv: -kv[1])[:3]
        lines.append("largest modules (pytest process): " + ", ".join(f"{m} {b / GIB:.2f} GiB" for m, b in top))
        return lines, within


def _budget(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def pytest_configure(config: pytest.Config) -> None:
    watch = RssWatch(_budget("RADIXMESH_TEST_RSS_BUDGET_GIB", 10), _budget("RADIXMESH_TEST_TREE_RSS_BUDGET_GIB", 16))
    config.stash[_KEY] = watch
    watch.start()


_KEY = pytest.StashKey[RssWatch]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    watch = item.config.stash.get(_KEY, None)
    if watch is not None:
        watch.module = item.nodeid.split("::")[0]
    yield
    if watch is not None:
        watch.sample(tree=False)  # cheap: the background thread walks the tree
    if nextitem is None or nextitem.path != item.path:  # the module's fixtures are torn down
        if watch is None or watch.grew_in_module():
            return_freed_memory()  # a gc pass and malloc_trim: ~0.1 s, so only after modules that grew


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    watch = session.config.stash.get(_KEY, None)
    if watch is None:
        return
    watch.stop()
    lines, within = watch.report()
    session.config.stash[_LINES] = lines
    if not within and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_LINES = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in config.stash.get(_LINES, []):
        terminalreporter.write_line(line, red="OVER" in line, bold=True)
