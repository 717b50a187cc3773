"""Stop strings wait for min_tokens (vLLM's semantics): none is looked for until more than
min_tokens token ids have been pushed, the way the sampler holds EOS back."""
from __future__ import annotations

import pytest

from services.detokenizer.incremental import IncrementalDetokenizer


class CharTokenizer:
    """One token per character (ids are code points): token counts equal character counts."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(text: str, stop: list[str], min_tokens: int, per_push: int = 1) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(CharTokenizer(), stop=stop, min_tokens=min_tokens)
    toks = ids(text)
    for i in range(0, len(toks), per_push):
        if detok.push(toks[i:i + per_push]).stopped:
            break
    detok.flush()
    return detok


@pytest.mark.parametrize("per_push", [1, 2])
def test_a_stop_string_inside_the_first_min_tokens_is_plain_text(per_push):
    detok = run("ab.cd", stop=["."], min_tokens=4, per_push=per_push)
    assert not detok.stopped and detok.text == "ab.cd"


def test_a_stop_string_after_min_tokens_still_stops():
    detok = run("ab.cd.ef", stop=["."], min_tokens=4)
    assert detok.stopped and detok.matched_stop == "." and detok.text == "ab.cd"


def test_the_first_token_past_min_tokens_is_checked_and_the_last_one_before_is_not():
    assert run("abc.", stop=["."], min_tokens=3).text == "abc"  # token 4 > min_tokens: stops
    detok = run("ab.", stop=["."], min_tokens=3)  # token 3 == min_tokens: not yet
    assert not detok.stopped and detok.text == "ab."


def test_a_stop_string_straddling_min_tokens_counts():
    detok = run("xEND tail", stop=["END"], min_tokens=2)  # "EN" within, "D" past min_tokens
    assert detok.stopped and detok.text == "x"


def test_held_text_from_before_min_tokens_cannot_complete_a_stop_later():
    # "xab" is held (a prefix of "xabc") while stops are off; the "ab" in it completed then,
    # so it must not fire once checking starts, while "xabc" completing afterwards does.
    detok = run("xabc", stop=["ab", "xabc"], min_tokens=3)
    assert detok.stopped and detok.matched_stop == "xabc" and detok.text == ""
    detok = run("xabz", stop=["ab", "xabc"], min_tokens=3)
    assert not detok.stopped and detok.text == "xabz"


def test_no_min_tokens_keeps_the_old_behaviour():
    detok = run("a.b", stop=["."], min_tokens=0)
    assert detok.stopped and detok.text == "a"


def test_the_request_ending_within_min_tokens_flushes_everything():
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["STOP"], min_tokens=10)
    assert detok.push(ids("aSTO")).text == "a"  # "STO" could still begin a stop: held
    assert detok.push(ids("P")).text == "STOP"  # completed within min_tokens: released
    assert detok.flush() == "" and not detok.stopped
