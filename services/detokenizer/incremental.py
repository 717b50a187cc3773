"""Incremental detokenization with stop strings: the transport-free core of the detokenizer stage.

Two layers, each holding text back for its own reason:

1. Tokens → stable text. Each push decodes a small sliding window of tokens twice, once up to the
   read offset (text already emitted, kept only as context) and once up to the end; the difference
   is the new text. Context matters because some decoders render a token differently at the start
   of a sequence (SentencePiece drops the leading space); both decodes start at the same token, so
   the difference is what one-shot decoding would add. When the new text ends in U+FFFD the last
   tokens end inside a UTF-8 sequence (byte-level BPE splits emoji and CJK characters across tokens),
   so nothing advances until a later token completes it.
2. Stable text → emitted text. Stop strings are searched in the held text plus the new text; the
   longest suffix that could still begin a stop string is held back, so no part of a stop string
   ever reaches an earlier delta.

Cost per push is O(window + chunk), not O(total): only the window's token ids are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"
# Tokens before the read offset kept as decoding context (vLLM and SGLang use the same few).
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class DetokDelta:
    """What one push adds. `text` is safe to send: never ends in a partial character, never holds
    any part of a stop string (unless include_stop_str_in_output). `stopped` stays True once set."""
    text: str
    stopped: bool = False
    matched_stop: str | None = None


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas for one request.

    Contract, when no stop string fires and the stream is valid UTF-8 at every clean boundary:
    `"".join(deltas) + flush() == tokenizer.decode(all_pushed_ids, skip_special_tokens)`
    (with `prompt_ids`, the prompt is decoding context only and is never emitted).

    Stop strings match on decoded text, across token and push boundaries. The first occurrence to
    complete in the stream wins (ties: the longer one, i.e. the one starting earlier). The emitted
    text ends right before it, or right after it with `include_stop_str_in_output`; text decoded
    after it is dropped. Empty stop strings are ignored.

    `min_tokens` (the request's min_new_tokens) delays stop strings as vLLM does, and as the
    sampler delays EOS: none is looked for until a push takes the count of pushed token ids past
    min_tokens. A stop string completed before then is plain text; one that straddles counts.

    Not thread-safe; one instance per request.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._min_tokens = max(min_tokens, 0)
        self._pushed = 0  # token ids pushed so far
        self._stale = 0  # leading chars of _held decoded before stop strings were checked
        self._skip_special = skip_special_tokens
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = include_stop_str_in_output
        prompt = list(prompt_ids or ())
        # _ids is the window: token ids from the prefix offset on. _read is the read offset,
        # relative to the window: text of _ids[:_read] has been passed on to the stop layer.
        self._ids: list[int] = prompt[max(len(prompt) - _CONTEXT_TOKENS, 0):]
        self._read = len(self._ids)
        self._held = ""  # stable text that could still begin a stop string
        self._parts: list[str] = []
        self._text_cache = ""
        self._stopped = False
        self._matched_stop: str | None = None
        self._flushed = False

    # ---- public API -------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """Everything emitted so far (all push deltas plus flush)."""
        if self._parts:
            self._text_cache += "".join(self._parts)
            self._parts.clear()
        return self._text_cache

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    def push(self, token_ids: Sequence[int]) -> DetokDelta:
        """Append generated token ids; return the text they make safe to emit.

        After a stop string has matched, returns an empty delta with stopped=True.
        Raises RuntimeError after flush().
        """
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream has ended")
        if self._stopped:
            return DetokDelta("", True, self._matched_stop)
        self._ids.extend(token_ids)
        self._pushed += len(token_ids)
        out = self._release(self._decode_stable(), final=False)
        return DetokDelta(out, self._stopped, self._matched_stop)

    def flush(self) -> str:
        """End the stream; return everything still held back.

        Trailing tokens that never completed a character are emitted as the tokenizer decodes them
        (usually U+FFFD); held text that could have begun a stop string is released, unless the
        flushed text completes a stop string, which is cut as in push(). Idempotent: a second call
        returns "". Check `stopped`/`matched_stop` afterwards for a stop found here.
        """
        if self._flushed or self._stopped:
            self._flushed = True
            return ""
        self._flushed = True
        tail = ""
        if self._read < len(self._ids):
            context = self._decode(self._ids[:self._read])
            full = self._decode(self._ids)
            tail = full[len(context):]
        return self._release(tail, final=True)

    # ---- layer 1: tokens → stable text ------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_stable(self) -> str:
        """New text from the pending tokens, or "" while they end inside a character (or decode to
        nothing, e.g. skipped special tokens). Advances the window when text is returned."""
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[:self._read])
        end, text = len(self._ids), self._decode(self._ids)
        # A chunk that ends inside a character may still hold clean text before it: a partial
        # UTF-8 sequence is at most 3 bytes, hence at most 3 tokens, so look back that far.
        while text.endswith(_REPLACEMENT) and end - self._read > 1 and len(self._ids) - end < 3:
            end -= 1
            text = self._decode(self._ids[:end])
        if len(text) <= len(context) or text.endswith(_REPLACEMENT):
            return ""
        # ids[:end] ends on a clean boundary: keep a few tokens before it as context for the next
        # decode. Any start token works since both decodes share it; only the end must be clean.
        drop = max(self._read, end - _CONTEXT_TOKENS)
        del self._ids[:drop]
        self._read = end - drop
        return text[len(context):]

    # ---- layer 2: stable text → emitted text ------------------------------------------------

    def _release(self, new_text: str, final: bool) -> str:
        """Run new stable text through the stop-string matcher; emit what is safe."""
        buf = self._held + new_text
        self._held = ""
        if not buf:
            return ""
        checking = self._min_tokens == 0 or self._pushed > self._min_tokens
        match = self._find_stop(buf, self._stale) if checking else None
        self._stale = 0
        if match is not None:
            start, stop = match
            out = buf[:start + len(stop)] if self._include_stop else buf[:start]
            self._stopped, self._matched_stop = True, stop
        elif final or not self._stops:
            out = buf
        else:
            hold = self._stop_prefix_len(buf)
            out, self._held = buf[:len(buf) - hold], buf[len(buf) - hold:]
            if not checking:  # what is held now was decoded too early to complete a stop string
                self._stale = len(self._held)
        if out:
            self._parts.append(out)
        return out

    def _find_stop(self, buf: str, stale: int = 0) -> tuple[int, str] | None:
        """(start, stop) of the occurrence that completes first; ties go to the earlier start.
        Only occurrences ending past buf[:stale] count (those completed before min_tokens don't).

        Any occurrence lies wholly in buf: text before buf held no stop-string prefix at its end.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop, max(stale - len(stop) + 1, 0))
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            suffix = buf[len(buf) - k:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return 0
