"""One OpenMP team per process (services/worker/omp_team.py): loading runs on a thread that
exits, and the Engine builds its runner on the thread that runs its steps."""
from __future__ import annotations

import threading

import pytest

from services.worker.loader import checkpoint as checkpoint_module
from services.worker.omp_team import on_own_thread


def test_on_own_thread_runs_elsewhere_returns_and_raises():
    caller = threading.get_ident()
    assert on_own_thread(threading.get_ident) != caller
    assert on_own_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="boom"):
        on_own_thread(lambda: {}["boom"])


def test_load_checkpoint_loads_off_the_callers_thread(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(checkpoint_module, "_load", lambda path, q, part: seen.append((threading.get_ident(), path, q)))
    checkpoint_module.load_checkpoint("some.gguf", "gguf")
    assert seen and seen[0][0] != threading.get_ident() and seen[0][1:] == ("some.gguf", "gguf")
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="does not exist"):  # the real loader's errors still reach the caller
        checkpoint_module.load_checkpoint(str(tmp_path / "missing.gguf"))


def test_the_engine_builds_its_runner_on_its_step_thread(checkpoint, tokenizer, monkeypatch):
    from services.common.sampling_params import SamplingParams
    from services.engine import engine as engine_module
    from services.scheduler.config import SchedulerConfig
    from services.worker import model_runner as runner_module
    from services.worker.config import WorkerConfig

    built, stepped = [], set()
    real_runner = runner_module.ModelRunner  # what the Engine's create_runner builds for a group of one

    class Recording(real_runner):
        def __init__(self, *args, **kwargs):
            built.append(threading.get_ident())
            super().__init__(*args, **kwargs)

        def execute(self, plan, *args, **kwargs):
            stepped.add(threading.get_ident())
            return super().execute(plan, *args, **kwargs)

    monkeypatch.setattr(runner_module, "ModelRunner", Recording)
    for overlap in (True, False):
        built.clear(), stepped.clear()
        eng = engine_module.Engine(worker=WorkerConfig(kv_cache_bytes=16 << 20, max_requests=2),
                                   scheduler=SchedulerConfig(max_running_requests=2,
                                                             disable_overlap_schedule=not overlap),
                                   checkpoint=checkpoint, tokenizer=tokenizer)
        try:
            out = eng.generate(prompt="The capital of France is", sampling=SamplingParams(temperature=0,
                                                                                         max_new_tokens=3))
            assert out.finished and len(out.token_ids) == 3
        finally:
            eng.shutdown()
        assert len(built) == 1 and stepped == {built[0]} and built[0] != threading.get_ident()
