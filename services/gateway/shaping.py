"""Backend events → OpenAI (and native /generate) response objects.

`Collector` folds the events of a request (one backend call per prompt) into
per-choice state and usage; the `*_chunk` functions shape one streamed event,
the `*_response` functions the whole non-streamed answer. Choice index =
prompt index * n + sequence index.

Usage: the backend's counters are cumulative per call, so a call's usage is the
largest value seen; completion tokens are also counted from the token ids
received, and the larger of the two wins. Calls (prompts) add up. Speculative
decoding's counters (summed over a call's n sequences by the scheduler) appear
as radixmesh's extra `usage.speculative` only when a verify step ran, so a
response without speculation keeps OpenAI's shape.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from services.common.outputs import FinishReason, RequestOutput, TokenLogprob, TopToken
from services.gateway.openai_protocol import ParsedRequest
from services.gateway.tools import ToolCallStream, parse_output


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    text_offset: int = 0  # characters of token text so far (completions logprobs)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked: one per prompt position


@dataclass
class _CallUsage:
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    counted: int = 0
    spec: tuple[int, int, int] = (0, 0, 0)  # verify steps, drafted tokens, accepted tokens


class Collector:
    def __init__(self, req: ParsedRequest) -> None:
        self.req = req
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(len(req.calls) * req.n)]
        self._usage = [_CallUsage() for _ in req.calls]
        self.weights_version = ""  # of the weights that computed the tokens (the backend's chunks say)
        # chat with tools, streamed: each choice's text → delta.tool_calls
        self.tool_streams = [ToolCallStream(req.tools) for _ in self.choices] if req.tools is not None else None

    def add(self, call_index: int, event: RequestOutput) -> int:
        """Record an event; returns its choice index."""
        index = call_index * self.req.n + event.index
        choice = self.choices[index]
        u = self._usage[call_index]
        # a prefill-only request (max_new_tokens 0) may have no event but its finish: that carries its usage
        u.prompt, u.cached = max(u.prompt, event.prompt_tokens), max(u.cached, event.cached_tokens)
        if event.finished:
            choice.finish_reason, choice.matched_stop = event.finish_reason, event.matched_stop
            return index
        self.weights_version = event.weights_version or self.weights_version
        u.completion = max(u.completion, event.completion_tokens)
        spec = (event.spec_verify_steps, event.spec_draft_tokens, event.spec_accepted_tokens)
        u.spec = tuple(map(max, u.spec, spec))
        u.counted += len(event.token_ids)
        choice.text += event.text
        choice.token_ids += event.token_ids
        choice.logprobs += event.logprobs
        choice.prompt_logprobs += event.prompt_logprobs
        return index

    def aborts(self) -> list[tuple[int, RequestOutput]]:
        """(call index, a finishing abort event) for every choice not finished yet."""
        n = self.req.n
        return [(i // n, RequestOutput(self.req.calls[i // n].rid, index=i % n, finished=True,
                                       finish_reason=FinishReason.ABORT))
                for i, c in enumerate(self.choices) if c.finish_reason is None]

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self, call: int | None = None) -> dict:
        """Summed over the calls, or of one call."""
        calls = self._usage if call is None else self._usage[call:call + 1]
        prompt = sum(u.prompt for u in calls)
        completion = sum(max(u.completion, u.counted) for u in calls)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(u.cached for u in calls)}}
        verify, draft, accepted = (sum(u.spec[i] for u in calls) for i in range(3))
        if verify:
            usage["speculative"] = {"verify_steps": verify, "draft_tokens": draft, "accepted_tokens": accepted,
                                    "acceptance_rate": round(accepted / draft, 4) if draft else 0.0}
        return usage

    def _envelope(self, obj: str) -> dict:
        env = {"id": self.req.id, "object": obj, "created": self.created, "model": self.req.model}
        if self.weights_version:  # OpenAI's field for "which backend configuration served this"
            env["system_fingerprint"] = f"weights-v{self.weights_version}"
        return env


# --- logprobs in OpenAI's two shapes ----------------------------------------------------

def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def _token(text: str | None, token_id: int) -> str:
    return text if text is not None else f"token_id:{token_id}"


def _bytes(lp: TokenLogprob | TopToken) -> list[int] | None:
    """The token's UTF-8 bytes: as the backend sent them (a piece of a character has no text
    of its own), else those of its text; None when it has neither."""
    if lp.bytes is not None:
        return list(lp.bytes)
    return list(lp.token.encode("utf-8")) if lp.token is not None else None


def chat_logprobs(lps: list[TokenLogprob]) -> dict:
    return {"content": [{
        "token": _token(lp.token, lp.token_id), "logprob": _finite(lp.logprob), "bytes": _bytes(lp),
        "top_logprobs": [{"token": _token(t.token, t.token_id), "logprob": _finite(t.logprob),
                          "bytes": _bytes(t)} for t in lp.top],
    } for lp in lps], "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], choice: Choice, top: int | None = None) -> dict:
    """Advances choice.text_offset past the tokens given. A prompt's first token (echo) has null
    logprobs; `top`: at most this many alternatives (echo's prompt tokens carry the larger of
    logprobs and prompt_logprobs)."""
    offsets = []
    for lp in lps:
        offsets.append(choice.text_offset)
        choice.text_offset += len(_token(lp.token, lp.token_id))
    return {
        "tokens": [_token(lp.token, lp.token_id) for lp in lps],
        "token_logprobs": [None if lp.logprob is None else _finite(lp.logprob) for lp in lps],
        "top_logprobs": [None if lp.logprob is None else
                         {_token(t.token, t.token_id): _finite(t.logprob) for t in lp.top[:top]} for lp in lps],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(lps: list[TokenLogprob], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt position {token id: {logprob, rank, decoded_token}}, the prompt
    token and its top k (rank: 1-based among the top k; null for a prompt token outside them); the first null."""
    out: list[dict | None] = []
    for lp in lps:
        if lp.logprob is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": _finite(t.logprob), "rank": r, "decoded_token": _token(t.token, t.token_id)}
                 for r, t in enumerate(lp.top[:k], 1)}
        if str(lp.token_id) not in entry:
            entry[str(lp.token_id)] = {"logprob": _finite(lp.logprob), "rank": None,
                                       "decoded_token": _token(lp.token, lp.token_id)}
        out.append(entry)
    return out


def _echo_text(col: Collector, index: int) -> str:
    """The prompt's text for echo: as given, or its tokens' bytes decoded (a token-id prompt)."""
    call = col.req.calls[index // col.req.n]
    if call.text is not None:
        return call.text
    raw = b"".join(lp.bytes if lp.bytes is not None else (lp.token or "").encode()
                   for lp in col.choices[index].prompt_logprobs)
    return raw.decode("utf-8", errors="replace")


# --- streamed chunks ---------------------------------------------------------------------

def stream_chunk(col: Collector, index: int, event: RequestOutput, first: bool) -> dict | None:
    """The SSE object for one event of choice `index` (None when there is nothing
    to send). `first` marks the first event of that choice (chat sends the role)."""
    req, choice = col.req, col.choices[index]
    if req.kind == "generate":
        return generate_object(col, index, meta=True)
    is_finish = event.finished
    if not is_finish and not event.text and not event.logprobs and not (first and req.kind == "chat"):
        return None
    out: dict = {"index": index}
    if req.kind == "chat":
        obj = col._envelope("chat.completion.chunk")
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if col.tool_streams is not None:
            tools = col.tool_streams[index]
            parts = tools.finish() if is_finish else tools.feed(event.text)
            delta.update(merge_deltas(parts))
            if not parts and not first and not is_finish and not event.logprobs:
                return None
        elif not is_finish and (event.text or not first):
            delta["content"] = event.text
        out["delta"] = delta
        out["logprobs"] = chat_logprobs(event.logprobs) if req.logprobs and not is_finish else None
    else:
        obj = col._envelope("text_completion")
        out["text"] = "" if is_finish else event.text
        out["logprobs"] = completion_logprobs(event.logprobs, choice) if req.logprobs and not is_finish else None
    out["finish_reason"] = _finish_reason(col, index) if is_finish else None
    if is_finish:
        out["matched_stop"] = choice.matched_stop
    obj["choices"] = [out]
    if req.include_usage:
        obj["usage"] = None
    return obj


def merge_deltas(parts: list[dict]) -> dict:
    """Several deltas of one event as one: content joined, fragments of one tool call joined."""
    delta: dict = {}
    for part in parts:
        if "content" in part:
            delta["content"] = delta.get("content", "") + part["content"]
        for call in part.get("tool_calls", []):
            calls = delta.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == call["index"]:
                fn = calls[-1].setdefault("function", {})
                fn["arguments"] = fn.get("arguments", "") + call["function"].get("arguments", "")
            else:
                calls.append({**call, "function": dict(call["function"])})
    return delta


def _finish_reason(col: Collector, index: int) -> FinishReason | str | None:
    """A choice that called a tool and stopped on its own ends with "tool_calls" (OpenAI's reason)."""
    reason = col.choices[index].finish_reason
    if reason is FinishReason.STOP and col.tool_streams is not None and col.tool_streams[index].called:
        return "tool_calls"
    return reason


def usage_chunk(col: Collector) -> dict:
    kind = "chat.completion.chunk" if col.req.kind == "chat" else "text_completion"
    return {**col._envelope(kind), "choices": [], "usage": col.usage()}


# --- whole responses -----------------------------------------------------------------------

def completion_response(col: Collector) -> dict:
    choices, req = [], col.req
    for i, c in enumerate(col.choices):
        c.text_offset = 0
        text, logprobs = c.text, None
        if req.echo:
            text = _echo_text(col, i) + c.text
        if req.logprobs:
            logprobs = completion_logprobs(c.logprobs, c)
            if req.echo:  # the prompt's tokens first, as OpenAI's legacy API returns them
                c.text_offset = 0
                head = completion_logprobs(c.prompt_logprobs, c, req.top_logprobs)
                tail = completion_logprobs(c.logprobs, c)
                logprobs = {key: head[key] + tail[key] for key in head}
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "matched_stop": c.matched_stop}
        if req.prompt_logprobs >= 0:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs, req.prompt_logprobs)
        choices.append(choice)
    return {**col._envelope("text_completion"), "choices": choices, "usage": col.usage()}


def chat_response(col: Collector) -> dict:
    obj = {**col._envelope("chat.completion"), "choices": [{
        "index": i, **_message(col, c),
        "logprobs": chat_logprobs(c.logprobs) if col.req.logprobs else None, "matched_stop": c.matched_stop,
    } for i, c in enumerate(col.choices)], "usage": col.usage()}
    if col.req.prompt_logprobs >= 0:  # vLLM: the one prompt's, at the top level
        obj["prompt_logprobs"] = vllm_prompt_logprobs(col.choices[0].prompt_logprobs, col.req.prompt_logprobs)
    return obj


def _message(col: Collector, c: Choice) -> dict:
    """The assistant message and finish_reason of a whole choice (tool calls parsed out of its text)."""
    message: dict = {"role": "assistant", "content": c.text, "refusal": None}
    reason = c.finish_reason
    if col.req.tools is not None and reason is not FinishReason.ABORT:
        content, calls = parse_output(col.req.tools, c.text)
        if calls:
            message["content"] = content
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
            reason = "tool_calls" if reason is FinishReason.STOP else reason
    return {"message": message, "finish_reason": reason}


def generate_object(col: Collector, index: int, meta: bool = True) -> dict:
    """SGLang's shape: the text and ids so far, and meta_info (usage, finish)."""
    c = col.choices[index]
    call = index // col.req.n
    usage = col.usage(call) if col.req.extra.get("batch") else col.usage()  # a batch: each prompt its own
    info: dict = {
        "id": col.req.calls[call].rid, "index": index,
        "finish_reason": None if c.finish_reason is None else {"type": c.finish_reason, "matched": c.matched_stop},
        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": len(c.token_ids),
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }
    if col.weights_version:
        info["weights_version"] = col.weights_version
    spec = usage.get("speculative")  # present when the request speculated, as in usage
    if spec:
        info |= {"spec_verify_ct": spec["verify_steps"], "spec_draft_tokens": spec["draft_tokens"],
                 "spec_accepted_tokens": spec["accepted_tokens"], "spec_acceptance_rate": spec["acceptance_rate"]}
    if col.req.logprobs:
        info["output_token_logprobs"] = [[_finite(lp.logprob), lp.token_id, lp.token] for lp in c.logprobs]
        info["output_top_logprobs"] = [[[_finite(t.logprob), t.token_id, t.token] for t in lp.top]
                                       for lp in c.logprobs]
    if col.req.input_logprobs:  # SGLang's: from logprob_start_len on, the prompt's first token's logprob null
        lps = c.prompt_logprobs
        info["input_token_logprobs"] = [[None if lp.logprob is None else _finite(lp.logprob), lp.token_id, lp.token]
                                        for lp in lps]
        info["input_top_logprobs"] = [None if lp.logprob is None else
                                      [[_finite(t.logprob), t.token_id, t.token] for t in lp.top] for lp in lps]
    return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": info}


def generate_response(col: Collector) -> dict | list[dict]:
    objs = [generate_object(col, i) for i in range(len(col.choices))]
    return objs[0] if len(objs) == 1 and not col.req.extra.get("batch") else objs
