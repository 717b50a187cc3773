"""The in-process Engine on the real model: a stop string found within the first
min_new_tokens tokens does not end the request (vLLM's min_tokens semantics)."""
from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig


@pytest.fixture(scope="module")
def engine(checkpoint, tokenizer):
    eng = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=4),
                 scheduler=SchedulerConfig(max_running_requests=4), checkpoint=checkpoint, tokenizer=tokenizer)
    yield eng
    eng.shutdown()


def test_stop_strings_wait_for_min_new_tokens(engine, tokenizer):
    ids = engine.prompt_ids(messages=[{"role": "user", "content": "Write a short story about a robot."}])
    k = 3
    plain = SamplingParams(temperature=0, max_new_tokens=16, min_new_tokens=k)
    full = engine.generate(input_ids=ids, sampling=plain)
    early = tokenizer.decode(full.token_ids[:k])
    assert full.text.startswith(early)
    stop = tokenizer.decode(full.token_ids[:1]).strip()  # text of the first token: inside the first k
    assert stop and full.text.find(stop) < len(early)

    cut = engine.generate(input_ids=ids, sampling=SamplingParams(
        temperature=0, max_new_tokens=16, min_new_tokens=k, stop=[stop]))
    later = full.text.find(stop, max(len(early) - len(stop) + 1, 0))  # first one completing past token k
    if later < 0:
        assert cut.finish_reason == full.finish_reason and cut.text == full.text
    else:
        assert cut.finish_reason == "stop" and cut.matched_stop == stop and cut.text == full.text[:later]
    assert len(cut.text) > full.text.find(stop)  # went past the early occurrence
