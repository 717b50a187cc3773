"""Shared fixtures: the default model loaded once, and the transformers reference.

Async tests and fixtures (pytest-asyncio, asyncio_mode = "auto") all run on uvloop, the
event loop the services run on (services/common/server.py).

The `slow` marker (`make test-fast` runs `-m "not slow"`) is set here for everything under
tests/integration and tests/e2e and for every test that takes the default model's weights
(the `checkpoint` or `hf_model` fixture, directly or through another fixture); modules that
are slow for another reason set `pytestmark = pytest.mark.slow`. A test outside `slow` that
loads the default model by itself fails, saying so.
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import uvloop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# peak RSS, printed and held to a budget, memory trimmed between modules; wall time per module
pytest_plugins = ("tests.rss_watch", "tests.module_times")

SLOW_DIRS = {"integration", "e2e"}  # the mesh, processes and the real model
MODEL_FIXTURES = {"checkpoint", "hf_model"}  # the default model's weights, ours and transformers'


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable]:
    """One loop factory for every async test and fixture: uvloop, as in production."""
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        parts = Path(item.path).resolve().relative_to(tests).parts
        if parts[0] in SLOW_DIRS or MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@functools.lru_cache(maxsize=1)
def _default_model_file() -> str | None:
    from services.common.model_path import default_model_path
    try:
        return os.path.realpath(default_model_path())
    except FileNotFoundError:
        return None


@pytest.fixture(autouse=True)
def _fast_tests_load_no_model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps the fast lane fast: a test not marked slow that loads the default model fails."""
    if request.node.get_closest_marker("slow") or _default_model_file() is None:
        return
    from services.worker.loader import gguf_loader

    load = gguf_loader.load_gguf

    def guarded(path: str, *args, **kwargs):
        if os.path.realpath(path) == _default_model_file():
            pytest.fail(f"{request.node.nodeid} loads the default model but is not marked slow: take the "
                        "`checkpoint` fixture, or mark it (or its module) `pytest.mark.slow`", pytrace=False)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(gguf_loader, "load_gguf", guarded)


@pytest.fixture(scope="session")
def model_path() -> str:
    from services.common.model_path import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def checkpoint(model_path):
    from services.worker.loader.checkpoint import load_checkpoint
    return load_checkpoint(model_path)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from services.tokenizer.text_tokenizer import load_tokenizer
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32)
    return model.eval()
