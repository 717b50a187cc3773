"""An in-process Backend with a made-up model: deterministic, instant, inspectable.

Used by the gateway's unit and fuzz tests (and handy for trying the HTTP API
without a model). It behaves like the mesh where the gateway can tell:
validation errors as INVALID_ARGUMENT with the core's messages, the context
limit, stop strings cut exactly and never leaked, stop token ids, EOS,
min_new_tokens, n sequences interleaved, logprobs with top alternatives,
cumulative usage counters, cached_tokens on a repeated prompt, speculative
decoding's counters (with `draft_tokens`, unless the request opts out), and an
abort when the consumer goes away (`aborted` lists the rids).

The "model": word-level tokens. A prompt's tokens are its whitespace-separated
words (chat messages are rendered as "role: content" lines first); output token
k of sequence i is WORDS[(start + k + i * 3) % len(WORDS)] where `start` depends
on the prompt (and on the seed unless greedy), so greedy output is a function of
the prompt alone. Token 0 is EOS; it is produced when the prompt contains the
word "eos" (as the 3rd output token).
"""
from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.common.outputs import FinishReason, RequestOutput, TokenLogprob, TopToken
from services.common.sampling_params import InvalidRequest
from services.gateway.backend import BackendError, Event, GenerateCall, ModelInfo

WORDS = ["<eos>"] + [f" {w}" for w in (
    "the quick brown fox jumps over lazy dog while bright stars shine above quiet hills "
    "and rivers run toward distant seas carrying stories of old ships café 東京 ünïcode").split()]
EOS = 0


@dataclass
class FakeBackend:
    model_name: str = "fake-model"
    context_length: int = 256
    token_delay_s: float = 0.0          # sleep before each token (disconnect tests)
    fail_after_tokens: int | None = None  # error mid-stream after this many tokens
    stall_after_tokens: int | None = None  # never finish: wait forever after this many tokens (drain tests)
    queue_full: bool = False            # refuse with RESOURCE_EXHAUSTED
    is_serving: bool = True
    # > 0: the backend "speculates": each token produced counts one verify step that drafted
    # this many tokens and accepted ceil(half) of them; a request with speculative=False does not.
    draft_tokens: int = 0
    calls: list[GenerateCall] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    _seen_prompts: set[tuple[int, ...]] = field(default_factory=set)

    @property
    def vocab_size(self) -> int:
        return len(WORDS)

    async def info(self) -> ModelInfo:
        if not self.is_serving:
            raise BackendError("UNAVAILABLE", "fake backend is down")
        return ModelInfo(self.model_name, self.vocab_size, self.context_length, (EOS,), True)

    async def not_ready(self) -> str | None:
        return None if self.is_serving else "fake backend is down"

    async def close(self) -> None:
        pass

    async def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [([EOS] if add_special_tokens else []) + self._ids(t) for t in texts]  # EOS stands in for BOS

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None,
                                  add_generation_prompt: bool) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt
                                                                               else "")

    async def detokenize(self, items: list[list[int]], skip_special_tokens: bool
                         ) -> tuple[list[str], list[list[str]]]:
        bad = [t for ids in items for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BackendError("INVALID_ARGUMENT", f"token ids {bad[:5]} are outside the vocabulary "
                                                   f"[0, {self.vocab_size})")
        return ["".join(WORDS[t] for t in ids if not (skip_special_tokens and t == EOS)) for ids in items], \
            [[WORDS[t] for t in ids] for ids in items]

    def _ids(self, text: str) -> list[int]:
        return [1 + zlib.crc32(w.encode()) % (len(WORDS) - 1) for w in text.split()]

    def tokenize_call(self, call: GenerateCall) -> list[int]:
        if call.input_ids is not None:
            return list(call.input_ids)
        text = call.text if call.text is not None else "".join(
            f"{m['role']}: {m['content']}\n" for m in call.messages or [])
        return self._ids(text)

    async def generate(self, call: GenerateCall) -> AsyncIterator[list[Event]]:
        if not self.is_serving:
            raise BackendError("UNAVAILABLE", "fake backend is down")
        if self.queue_full:
            raise BackendError("RESOURCE_EXHAUSTED", "1 requests are waiting (limit 1)")
        self.calls.append(call)
        ids = self.tokenize_call(call)
        sp = call.sampling
        try:
            if not ids:
                raise InvalidRequest("the prompt is empty")
            if call.fill_context:  # as the tokenizer service does for an unset max_new_tokens
                room = self.context_length - len(ids)
                if room < 1:
                    raise InvalidRequest(f"the prompt ({len(ids)} tokens) leaves no room for output within the "
                                         f"model's context length of {self.context_length} tokens")
                sp.max_new_tokens = min(room, call.fill_cap or room)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
            sp.validate(self.vocab_size)
            if len(ids) + sp.max_new_tokens > self.context_length:
                raise InvalidRequest(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                    f"{len(ids) + sp.max_new_tokens} exceeds the model's context length of "
                    f"{self.context_length} tokens")
        except InvalidRequest as e:
            raise BackendError("INVALID_ARGUMENT", str(e)) from None
        key = tuple(ids)
        cached = len(ids) - 1 if key in self._seen_prompts else 0
        self._seen_prompts.add(key)
        eos_at = 2 if "eos" in (call.text or str(call.messages) or "").split() else None
        base = zlib.crc32(repr(key).encode()) + (0 if sp.is_greedy else (sp.seed or 0))
        seqs = [_Sequence(i, base + i * 3, sp, eos_at, call.include_stop_str_in_output) for i in range(call.n)]
        self.active.add(call.rid)
        finished, produced = False, 0
        extras = _prompt_extras(ids, sp)
        try:
            if sp.max_new_tokens == 0:  # prefill only: what the prompt asked for, then the finish
                yield [RequestOutput(call.rid, index=s.index, prompt_tokens=len(ids), **extras) for s in seqs] + [
                    RequestOutput(call.rid, index=s.index, finished=True, finish_reason=FinishReason.LENGTH)
                    for s in seqs]
                seqs = []
            while not all(s.done for s in seqs):
                for s in seqs:
                    if s.done:
                        continue
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    else:
                        await asyncio.sleep(0)
                    if self.fail_after_tokens is not None and produced >= self.fail_after_tokens:
                        raise BackendError("INTERNAL", "worker error: injected failure")
                    if self.stall_after_tokens is not None and produced >= self.stall_after_tokens:
                        await asyncio.Event().wait()  # until cancelled
                    produced += 1
                    chunk = s.step(call.rid)
                    if s.k == 1:
                        chunk.prompt_logprobs, chunk.embedding = extras["prompt_logprobs"], extras["embedding"]
                    chunk.prompt_tokens, chunk.cached_tokens = len(ids), cached
                    chunk.completion_tokens = produced
                    if self.draft_tokens and sp.speculative:
                        chunk.spec_verify_steps, chunk.spec_draft_tokens, chunk.spec_accepted_tokens = (
                            produced, produced * self.draft_tokens, produced * ((self.draft_tokens + 1) // 2))
                    batch = [chunk]  # one backend message: the step's output and its finish
                    if s.done:
                        batch.append(RequestOutput(call.rid, index=s.index, finished=True, finish_reason=s.reason,
                                                   matched_stop=s.matched))
                    yield batch
            finished = True
        finally:
            self.active.discard(call.rid)
            if not finished:
                self.aborted.append(call.rid)


def _prompt_extras(ids: list[int], sp) -> dict:
    """Made-up prompt logprobs (-0.5 each, top k ids 0..k-1) and a unit embedding, when asked."""
    lps = []
    if sp.prompt_logprobs >= 0:
        lps = [TokenLogprob(t, None if j == 0 else -0.5, [] if j == 0 else
                            [TopToken(i, -0.1 * (i + 1), f"t{i}") for i in range(sp.prompt_logprobs)], f"t{t}")
               for j, t in enumerate(ids) if j >= sp.logprob_start_len]
    return {"prompt_logprobs": lps, "embedding": [0.6, 0.8] if sp.embed else []}


class _Sequence:
    def __init__(self, index: int, start: int, sp, eos_at: int | None, include_stop: bool) -> None:
        self.index, self.start, self.sp, self.eos_at, self.include_stop = index, start, sp, eos_at, include_stop
        self.k = 0
        self.text = ""      # all text so far (stop strings not yet cut)
        self.emitted = 0    # characters of `text` already sent
        self.done = False
        self.reason = FinishReason.LENGTH
        self.matched: str | int | None = None

    def _token(self) -> int:
        if self.eos_at is not None and self.k == self.eos_at:
            return EOS
        return 1 + (self.start + self.k) % (len(WORDS) - 1)

    def step(self, rid: str) -> RequestOutput:
        sp = self.sp
        tok = self._token()
        self.k += 1
        lp = TokenLogprob(tok, -0.25, token=WORDS[tok], top=[
            TopToken(t, -0.25 * (r + 1), WORDS[t])
            for r, t in enumerate([tok] + [(tok + j) % len(WORDS) for j in range(1, sp.top_logprobs)])
        ][:sp.top_logprobs]) if sp.logprobs else None
        chunk = RequestOutput(rid, [tok], [lp] if lp else [], index=self.index)
        can_stop = self.k > sp.min_new_tokens
        if tok == EOS and can_stop and not sp.ignore_eos:
            self.done, self.reason = True, FinishReason.STOP
        elif tok in sp.stop_token_ids and can_stop:
            self.done, self.reason, self.matched = True, FinishReason.STOP, tok
        else:
            self.text += WORDS[tok] if tok != EOS else ""
        chunk.text = self._release()
        if not self.done and self.k >= sp.max_new_tokens:
            self.done = True
            chunk.text += self.text[self.emitted:]
            self.emitted = len(self.text)
        return chunk

    def _release(self) -> str:
        """Text now safe to send: up to a matched stop string (which ends the
        sequence), else all but a tail that could still begin one."""
        hits = [(self.text.find(s, max(0, self.emitted - len(s) + 1)), s) for s in self.sp.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits and self.k > self.sp.min_new_tokens:
            pos, s = min(hits)
            self.done, self.reason, self.matched = True, FinishReason.STOP, s
            out = self.text[self.emitted:pos + (len(s) if self.include_stop else 0)]
            self.emitted = len(self.text)
            return out
        hold = 0 if self.done else max(
            [n for s in self.sp.stop for n in range(1, len(s)) if self.text.endswith(s[:n])] or [0])
        safe = len(self.text) - hold
        out = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return out
