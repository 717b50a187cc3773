"""tests/module_times.py: a module's wall time is summed over its visits, and the summary names
the slowest first with the total."""
from __future__ import annotations

from tests.module_times import ModuleTimes


def test_time_is_summed_per_module_and_the_slowest_come_first():
    times = ModuleTimes()
    times.enter("tests/unit/test_a.py", 0.0)
    times.enter("tests/unit/test_a.py", 1.0)  # a second test of the same module: no split
    times.enter("tests/unit/test_b.py", 2.0)
    times.leave(7.0)
    times.enter("tests/unit/test_a.py", 10.0)  # a module visited again (a rerun, a plugin's order)
    times.leave(13.0)
    assert times.seconds == {"tests/unit/test_a.py": 5.0, "tests/unit/test_b.py": 5.0}
    times.enter("tests/unit/test_c.py", 20.0)
    times.leave(80.0)
    assert times.slowest(2) == [("tests/unit/test_c.py", 60.0), ("tests/unit/test_a.py", 5.0)]
    summary = times.summary(1)
    assert "3 modules, 1.2 min" in summary and summary.endswith("tests/unit/test_c.py 60 s")


def test_leaving_twice_counts_once():
    times = ModuleTimes()
    times.enter("m", 0.0)
    times.leave(2.0)
    times.leave(5.0)
    assert times.seconds == {"m": 2.0}
