"""SequenceText, the one code that turns a sequence's outputs into text (the detokenizer service
runs it for the mesh, the Engine in process). A sequence's final output keeps the text of every
token but a matched stop token: a speculative or jump-forward step that ends in EOS carries
several tokens, and the Engine used to drop the whole final chunk's text."""
from __future__ import annotations

from services.common.outputs import FinishReason, RequestOutput, TokenLogprob, TopToken
from services.common.text_options import TextOptions
from services.detokenizer.sequence_text import SequenceText
from tests.unit.test_detokenizer import ByteTokenizer

EOS = 256  # ByteTokenizer's <|endoftext|>


def _apply(outputs: list[RequestOutput], **options) -> tuple[list[RequestOutput], list[bool]]:
    seq = SequenceText(ByteTokenizer(), TextOptions(**options))
    pairs = [seq.apply(out) for out in outputs]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_a_multi_token_step_ending_in_eos_keeps_its_other_tokens_text():
    outputs = [RequestOutput("r", token_ids=list(b"Fifty")),
               RequestOutput("r", token_ids=list(b" percent.") + [EOS], finished=True,
                             finish_reason=FinishReason.STOP, matched_stop=EOS)]
    shown, stopped = _apply(outputs)
    assert _text(shown) == "Fifty percent."
    assert shown[-1].finished and shown[-1].matched_stop == EOS and stopped == [False, False]


def test_a_length_finish_keeps_every_token():
    shown, _ = _apply([RequestOutput("r", token_ids=list(b"abc"), finished=True, finish_reason=FinishReason.LENGTH)])
    assert _text(shown) == "abc"


def test_a_stop_string_ends_the_sequence_here_and_says_the_scheduler_must_hear():
    outputs = [RequestOutput("r", token_ids=list(b"one. two")),
               RequestOutput("r", token_ids=list(b" three")),  # produced before the scheduler heard
               RequestOutput("r", token_ids=list(b"!"), finished=True, finish_reason=FinishReason.LENGTH)]
    shown, stopped = _apply(outputs, stop=(". t",))
    assert _text(shown) == "one"
    assert stopped == [True, False, False]
    first = shown[0]
    assert first.finished and first.finish_reason is FinishReason.STOP and first.matched_stop == ". t"
    assert shown[1].token_ids == [] and shown[2].token_ids == []  # nothing after the end


def test_a_stop_string_across_outputs_holds_its_prefix_back():
    outputs = [RequestOutput("r", token_ids=list(b"ab E")), RequestOutput("r", token_ids=list(b"ND cd"))]
    shown, stopped = _apply(outputs, stop=("END",))
    assert [o.text for o in shown] == ["ab ", ""]
    assert stopped == [False, True] and shown[1].matched_stop == "END"


def test_held_back_text_is_released_at_the_finish():
    outputs = [RequestOutput("r", token_ids=list(b"ab E")),
               RequestOutput("r", finished=True, finish_reason=FinishReason.ABORT)]
    shown, _ = _apply(outputs, stop=("END",))
    assert _text(shown) == "ab E" and shown[-1].finish_reason is FinishReason.ABORT


def test_include_stop_str_in_output_keeps_the_stop_string():
    shown, _ = _apply([RequestOutput("r", token_ids=list(b"x.END.y"))], stop=("END",), include_stop_str_in_output=True)
    assert _text(shown) == "x.END"


def test_logprobs_get_their_tokens_text_and_bytes():
    seq = SequenceText(ByteTokenizer(), TextOptions(), token_text=lambda i: (chr(i), bytes([i])))
    lp = TokenLogprob(ord("a"), -0.5, [TopToken(ord("b"), -1.0)])
    out, _ = seq.apply(RequestOutput("r", token_ids=[ord("a")], logprobs=[lp]))
    assert (out.logprobs[0].token, out.logprobs[0].bytes) == ("a", b"a")
    assert (out.logprobs[0].top[0].token, out.logprobs[0].top[0].bytes) == ("b", b"b")
