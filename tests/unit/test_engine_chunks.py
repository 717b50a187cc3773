"""Engine._to_chunk: a request's final chunk keeps the text of every token but a matched stop
token. A speculative or jump-forward step that ends in EOS carries several tokens; before this
test the whole chunk's text was dropped (the mesh's tokenizer dropped only the stop token)."""
from __future__ import annotations

from services.common.outputs import FinishReason, RequestOutput
from services.detokenizer.incremental import IncrementalDetokenizer
from services.engine.engine import Engine, _Handle
from services.common.sampling_params import SamplingParams
from tests.unit.test_detokenizer import ByteTokenizer

EOS = 256  # ByteTokenizer's <|endoftext|>


class _Scheduler:
    def __init__(self):
        self.finished_early: list[tuple] = []

    def finish_early(self, rid, reason, matched) -> None:
        self.finished_early.append((rid, reason, matched))


def _chunk(outputs: list[RequestOutput], stop: list[str] = (), scheduler: _Scheduler | None = None) -> str:
    engine = Engine.__new__(Engine)  # _to_chunk needs no model
    engine.scheduler = scheduler or _Scheduler()
    handle = _Handle("r", [], SamplingParams(), lambda c: None,
                     IncrementalDetokenizer(ByteTokenizer(), stop=list(stop)))
    return "".join(engine._to_chunk(handle, out).text for out in outputs)


def test_a_multi_token_step_ending_in_eos_keeps_its_other_tokens_text():
    tokens = list(b" percent.")
    outputs = [RequestOutput("r", token_ids=list(b"Fifty")),
               RequestOutput("r", token_ids=tokens + [EOS], finished=True, finish_reason=FinishReason.STOP,
                             matched_stop=EOS)]
    assert _chunk(outputs) == "Fifty percent."


def test_a_length_finish_keeps_every_token():
    outputs = [RequestOutput("r", token_ids=list(b"abc"), finished=True, finish_reason=FinishReason.LENGTH)]
    assert _chunk(outputs) == "abc"


def test_a_stop_string_ends_the_text_before_it():
    outputs = [RequestOutput("r", token_ids=list(b"one. two")),
               RequestOutput("r", token_ids=list(b" three"), finished=True, finish_reason=FinishReason.LENGTH)]
    scheduler = _Scheduler()
    assert _chunk(outputs, stop=[". t"], scheduler=scheduler) == "one"
    assert scheduler.finished_early == [("r", FinishReason.STOP, ". t")]  # the request ends upstream too
