"""IncrementalDetokenizer: streaming equals one-shot decode, stop strings never leak, cost is bounded."""
from __future__ import annotations

import functools
import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from services.detokenizer.incremental import DetokDelta, IncrementalDetokenizer

FFFD = "\ufffd"

TEXTS = [
    "Hello, world!",
    "Family: 👨‍👩‍👧‍👦 and 👩🏽‍💻, flags 🇯🇵🇫🇷🏳️‍🌈 done",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Ça déjà vu, naïve façade, Ångström, Zürich, ñandú",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x:\n\t\tpass\n",
    "lots   of    spaces\n\n\n   and\ttabs \t \n",
    " leading space and trailing space ",
    "mixed 🙂中文 café 🇺🇸 end.",
    "emoji at the very end 🎉",
    "Ὀδυσσεύς ∑∫√ ∞ ≠ ≤ → ㊗️ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


# ---- tokenizers ------------------------------------------------------------------------------

class ByteTokenizer:
    """One token per UTF-8 byte, so every multi-byte character is split; 256/257 are special."""
    SPECIAL = {256: "<|endoftext|>", 257: "<|im_end|>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", "replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self.SPECIAL[i])
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)


class PieceTokenizer:
    """SentencePiece-like: "▁" marks a space and the sequence's first leading space is dropped,
    so a token decodes differently at the start of a window than in the middle."""
    PIECES = ["▁Hello", "▁world", ",", "▁how", "▁are", "▁you", "?", "▁", "!"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(self.PIECES[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


class Counting:
    """Records the length of every decode call's input."""

    def __init__(self, inner) -> None:
        self.inner, self.lengths = inner, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=1)
def _smol():
    try:
        from services.common.model_path import default_model_path
        path = default_model_path()
    except FileNotFoundError as exc:
        return exc
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def smol():
    tok = _smol()
    if isinstance(tok, Exception):
        pytest.skip(f"default model unavailable: {tok}")
    return tok


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None,
           ) -> tuple[list[DetokDelta], str]:
    """Push ids one at a time (or in random chunks of 1..8 with rng); return deltas and flush()."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 8) if rng else 1
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    return deltas, detok.flush()


def joined(deltas: list[DetokDelta]) -> str:
    return "".join(d.text for d in deltas)


# ---- streaming == one-shot -------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_real_tokenizer_stream_equals_one_shot(text: str, chunked: bool) -> None:
    tok = smol()
    ids = encode(tok, text)
    for seed in range(3 if chunked else 1):
        detok = IncrementalDetokenizer(tok)
        deltas, tail = stream(detok, ids, random.Random(seed) if chunked else None)
        assert all(FFFD not in d.text for d in deltas)
        assert tail == ""  # valid text ends on a character boundary
        assert joined(deltas) == detok.text == tok.decode(ids, skip_special_tokens=True)
        assert not any(d.stopped for d in deltas)


def test_real_tokenizer_splits_characters_across_tokens() -> None:
    """Guards the test above: byte-level BPE really does cut these emoji and CJK characters."""
    tok = smol()
    for text in (TEXTS[1], TEXTS[2]):
        assert any(FFFD in tok.decode([i]) for i in encode(tok, text))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_stream_equals_one_shot(text: str) -> None:
    tok = ByteTokenizer()
    for rng in (None, random.Random(1)):
        detok = IncrementalDetokenizer(tok)
        deltas, tail = stream(detok, tok.encode(text), rng)
        assert all(FFFD not in d.text for d in deltas)
        assert joined(deltas) + tail == text


def test_leading_space_context_matches_one_shot() -> None:
    tok = PieceTokenizer()
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 7, 0]
    for rng in (None, random.Random(0), random.Random(1)):
        deltas, tail = stream(IncrementalDetokenizer(tok), ids, rng)
        assert joined(deltas) + tail == tok.decode(ids) == "Hello world, how are you? !  Hello"


def test_prompt_is_context_not_output() -> None:
    tok = smol()
    prompt, gen = encode(tok, "User: say hi\nAssistant:"), encode(tok, " Hi there 🎉 日本")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas, tail = stream(detok, gen)
    assert joined(deltas) + tail == tok.decode(prompt + gen)[len(tok.decode(prompt)):]

    piece = PieceTokenizer()  # without the prompt as context the first space would be lost
    deltas, tail = stream(IncrementalDetokenizer(piece, prompt_ids=[0]), [1, 2])
    assert joined(deltas) + tail == " world,"


# ---- stop strings ----------------------------------------------------------------------------

_ALPHABET = st.sampled_from(list("ab cdé\n\t日本語🎉👍🏽") + ["👨‍👩‍👧", "🇯🇵", "  "])
# The GGUF tokenizer cannot encode some code points at or above U+40000 (they decode to U+FFFD).
_CHARS = st.one_of(_ALPHABET, st.characters(blacklist_categories=("Cs",), max_codepoint=0x3FFFF,
                                            blacklist_characters=FFFD))


@st.composite
def text_and_stop(draw, tok_name: str) -> tuple[str, list[int], str]:
    raw = "".join(draw(st.lists(_CHARS, min_size=1, max_size=40)))
    if tok_name == "byte":
        ids = ByteTokenizer().encode(raw)
        text = raw
    else:
        ids = encode(smol(), raw)
        text = smol().decode(ids)
    assume(text and FFFD not in text)
    i = draw(st.integers(0, len(text) - 1))
    j = draw(st.integers(i + 1, min(len(text), i + 8)))
    return text, ids, text[i:j]


@pytest.mark.parametrize("tok_name", ["byte", "smol"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_exactly(tok_name: str, include: bool) -> None:
    tok = ByteTokenizer() if tok_name == "byte" else smol()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=text_and_stop(tok_name), seed=st.integers(0, 3))
    def check(case: tuple[str, list[int], str], seed: int) -> None:
        text, ids, stop = case
        detok = IncrementalDetokenizer(tok, stop=[stop], include_stop_str_in_output=include)
        deltas, tail = stream(detok, ids, random.Random(seed) if seed else None)
        cut = text.find(stop) + (len(stop) if include else 0)
        assert joined(deltas) == detok.text == text[:cut]
        assert tail == ""
        assert all(FFFD not in d.text for d in deltas)
        assert detok.stopped and detok.matched_stop == stop
        first = next(k for k, d in enumerate(deltas) if d.stopped)
        assert all(not d.stopped and d.matched_stop is None for d in deltas[:first])
        assert all(d == DetokDelta("", True, stop) for d in deltas[first + 1:])

    check()


def test_stop_spanning_token_boundaries_never_leaks() -> None:
    tok = smol()
    text, stop = "The quick brown fox jumps over the lazy dog", "ck brown fo"
    ids = encode(tok, text)
    assert not any(stop in tok.decode([i]) for i in ids)  # really spans several tokens
    detok = IncrementalDetokenizer(tok, stop=[stop])
    deltas, tail = stream(detok, ids)
    # Deltas only ever append, so an exact total means no piece of the stop string leaked.
    assert joined(deltas) == "The qui" and tail == ""
    first = next(k for k, d in enumerate(deltas) if d.stopped)
    assert deltas[first].matched_stop == stop and not any(d.stopped for d in deltas[:first])
    assert all(d == DetokDelta("", True, stop) for d in deltas[first + 1:])


@pytest.mark.parametrize("stops, expected, matched", [
    (["goodbye", "world"], "Hello ", "world"),
    (["world", "goodbye"], "Hello ", "world"),
    (["xyz", ", good"], "Hello world", ", good"),
    (["o w", "ld"], "Hell", "o w"),
    (["llo world, goodbye", "o w"], "Hell", "o w"),  # the one that completes first wins
    (["lo", "llo"], "He", "llo"),                      # same end: the earlier start wins
    (["", "zzz"], "Hello world, goodbye world", None),  # empty stop strings are ignored
])
def test_multiple_stop_strings(stops: list[str], expected: str, matched: str | None) -> None:
    text = "Hello world, goodbye world"
    for tok in (ByteTokenizer(), smol()):
        ids = tok.encode(text) if isinstance(tok, ByteTokenizer) else encode(tok, text)
        for rng in (None, random.Random(7)):
            detok = IncrementalDetokenizer(tok, stop=stops)
            deltas, tail = stream(detok, ids, rng)
            assert joined(deltas) + tail == expected
            assert detok.matched_stop == matched and detok.stopped == (matched is not None)


def test_include_stop_str_in_output() -> None:
    tok = smol()
    detok = IncrementalDetokenizer(tok, stop=["日本", "fox"], include_stop_str_in_output=True)
    deltas, tail = stream(detok, encode(tok, "a quick 日本語 fox"))
    assert joined(deltas) == "a quick 日本" and tail == "" and detok.matched_stop == "日本"


def test_push_after_stop_is_empty() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["!"])
    assert detok.push(tok.encode("hi! more")) == DetokDelta("hi", True, "!")
    assert detok.push(tok.encode("even more")) == DetokDelta("", True, "!")
    assert detok.flush() == "" and detok.text == "hi"


# ---- special tokens --------------------------------------------------------------------------

def test_special_tokens_skipped_or_kept() -> None:
    tok = smol()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "Hi 🎉") + [im_end] + encode(tok, " there")
    for skip in (True, False):
        deltas, tail = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert joined(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=True) == "Hi 🎉 there"
    assert tok.decode(ids, skip_special_tokens=False) == "Hi 🎉<|im_end|> there"

    kept = IncrementalDetokenizer(tok, skip_special_tokens=False, stop=["<|im_end|>"])
    assert joined(stream(kept, ids)[0]) == "Hi 🎉" and kept.matched_stop == "<|im_end|>"
    skipped = IncrementalDetokenizer(tok, skip_special_tokens=True, stop=["<|im_end|>"])
    assert joined(stream(skipped, ids)[0]) == "Hi 🎉 there" and not skipped.stopped


def test_special_token_between_split_bytes() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a") + [257] + tok.encode("日b")
    for skip in (True, False):
        deltas, tail = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert joined(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
        assert all(FFFD not in d.text for d in deltas)


# ---- flush -----------------------------------------------------------------------------------

def test_flush_emits_incomplete_utf8_as_decoded() -> None:
    tok = smol()
    ids = encode(tok, "ok 🎉")
    ids = ids[:-1]  # cut the emoji mid-character
    detok = IncrementalDetokenizer(tok)
    deltas, tail = stream(detok, ids)
    assert all(FFFD not in d.text for d in deltas)
    assert FFFD in tail and joined(deltas) + tail == tok.decode(ids) == detok.text
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match=r"push\(\) after flush\(\): the stream has ended"):
        detok.push([1])


def test_flush_releases_held_stop_prefix() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["world"])
    assert detok.push(tok.encode("hello wor")).text == "hello "
    assert detok.flush() == "wor" and not detok.stopped and detok.text == "hello wor"


def test_flush_never_emits_a_stop_string() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["a" + FFFD])
    assert detok.push(list(b"xa\xe6")).text == "x"
    assert detok.flush() == "" and detok.stopped and detok.matched_stop == "a" + FFFD


# ---- cost ------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 64])
def test_push_cost_is_bounded_by_window(chunk: int) -> None:
    tok = smol()
    counting = Counting(tok)
    ids = (encode(tok, " ".join(TEXTS)) * 40)[:2000]
    assert len(ids) == 2000
    detok = IncrementalDetokenizer(counting, stop=["never appears ∅"])
    out = []
    for i in range(0, len(ids), chunk):
        out.append(detok.push(ids[i:i + chunk]).text)
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids)
    pushes = len(ids) // chunk
    assert max(counting.lengths) <= chunk + 16
    assert sum(counting.lengths) <= pushes * 4 * (chunk + 16)
    assert len(counting.lengths) <= 4 * pushes + 2  # 2 per push, 2 more if it ends mid-character


def test_chunk_ending_mid_character_emits_its_clean_part() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(list("ab日".encode())[:-1]).text == "ab"
    assert detok.push(list("日".encode())[-1:]).text == "日"
