"""Wall time per test module, printed at the end of the run: the slowest modules and the total.

The suite must fit CI on the slower CPU (docs/testing.md). This says where its time goes in every
run, without a second run under --durations. A module's time runs from its first test's setup to
its last test's teardown (its module fixtures included)."""
from __future__ import annotations

import time

import pytest

SHOWN = 15


class ModuleTimes:
    """Seconds per module, accumulated as the run enters and leaves modules."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._module: str | None = None
        self._since = 0.0

    def enter(self, module: str, now: float) -> None:
        if module != self._module:
            self.leave(now)
            self._module, self._since = module, now

    def leave(self, now: float) -> None:
        if self._module is not None:
            self.seconds[self._module] = self.seconds.get(self._module, 0.0) + now - self._since
            self._module = None

    def slowest(self, n: int) -> list[tuple[str, float]]:
        return sorted(self.seconds.items(), key=lambda item: -item[1])[:n]

    def summary(self, n: int = SHOWN) -> str:
        total = sum(self.seconds.values())
        top = ", ".join(f"{module} {seconds:.0f} s" for module, seconds in self.slowest(n))
        return f"slowest modules (wall, fixtures included; {len(self.seconds)} modules, {total / 60:.1f} min): {top}"


_KEY = pytest.StashKey[ModuleTimes]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = ModuleTimes()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    times = item.config.stash[_KEY]
    times.enter(item.nodeid.split("::")[0], time.perf_counter())
    yield
    if nextitem is None or nextitem.path != item.path:  # its module fixtures were torn down just now
        times.leave(time.perf_counter())


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    times = config.stash.get(_KEY, None)
    if times is not None and times.seconds:
        terminalreporter.write_line(times.summary())
