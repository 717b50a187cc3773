"""The in-process engine's flags (`radixmesh generate`) flatten the worker's and the scheduler's
configs into one namespace: no two fields may map onto one flag."""
from __future__ import annotations

import argparse

from services.common.config import flags_from_dataclass
from services.engine.engine import EngineConfig


def test_engine_flags_build_without_collisions():
    parser = argparse.ArgumentParser()
    flags_from_dataclass(EngineConfig, parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--grammar-backend", "--grammar-checker", "--grammar-cache-size", "--grammars-remembered",
            "--jump-forward", "--no-jump-forward"} <= flags
