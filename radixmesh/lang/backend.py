"""What a program's state asks of a server, and the part every backend shares.

A backend answers: role_format() (the chat template's text around each role), generate(text, gen)
→ (text, meta_info), generate_stream(text, gen) → (piece, meta_info)..., prefill(text) → meta_info,
choice_logprobs(prompt, choices, unconditional) → per choice its tokens' logprobs (and without the
prompt), and flush_cache(). meta_info is SGLang's: prompt_tokens, completion_tokens, cached_tokens,
finish_reason ({"type": "stop" | "length" | "abort", "matched": the stop or None}).

Backend below implements role_format (learnt from `render`), generate (joining generate_stream)
and choice_logprobs (from `prompt_logprobs`, by `score`); a transport implements the rest:
backend_http.py (/generate), backend_grpc.py (the tokenizer's Generate), backend_openai.py
(/v1/completions)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

from radixmesh.lang import template
from radixmesh.lang.ir import Gen

Row = list  # [logprob | None, token id, token text | None]: SGLang's input_token_logprobs entry


class BackendError(RuntimeError):
    pass


def sse_events(request, what: str, timeout_s: float) -> Iterator[dict]:
    """POST `request` (a urllib Request) and yield its server-sent events' JSON, until [DONE];
    an HTTP error or an error event raises BackendError naming `what` ("POST /generate")."""
    try:
        resp = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        raise BackendError(f"{what}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    with resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise BackendError(f"{what} (stream): {event['error']}")
            yield event


def score(prompt: str, choices: list[str], unconditional: bool, prompt_len, logprobs
          ) -> tuple[list[list[float]], list[list[float]] | None]:
    """Each choice's tokens' logprobs after `prompt`, healing the boundary: the prompt + choice
    text is tokenized whole, and its token at the prompt's last position belongs to the choice
    when the merge changed it (" " + "Paris" → " Paris"), to the prompt when the prompt's text
    still ends with it. `logprobs(texts or id lists, start)` gives one list of Rows per item, from
    position `start` on; `prompt_len(text)` the prompt's token count."""
    n = prompt_len(prompt)
    start = max(n - 1, 0)
    rows = logprobs([prompt + c for c in choices], start)
    cond, ids = [], []
    for row in rows:
        if n and row and row[0][2] is not None and prompt.endswith(row[0][2]):
            row = row[1:]  # the prompt's own last token: no healing happened
        cond.append([lp for lp, _, _ in row if lp is not None])
        ids.append([tid for _, tid, _ in row])
    if not unconditional:
        return cond, None
    urows = logprobs(ids, 0)
    return cond, [[lp for lp, _, _ in r] for r in urows]


class Backend:
    """The shared part; a transport overrides render, generate_stream, prefill, prompt_logprobs
    (and generate, flush_cache where it has a better call)."""

    def __init__(self, role_format: template.RoleFormat | None = None) -> None:
        self._format = role_format

    def role_format(self) -> template.RoleFormat:
        if self._format is None:
            self._format = template.learn(self.render)
        return self._format

    def render(self, messages: list[dict]) -> str:
        """The server's chat template over `messages`, without a generation prompt."""
        raise NotImplementedError

    def generate(self, text: str, g: Gen) -> tuple[str, dict]:
        out, meta = [], {}
        for piece, meta in self.generate_stream(text, g):
            out.append(piece)
        return "".join(out), meta

    def generate_stream(self, text: str, g: Gen) -> Iterator[tuple[str, dict]]:
        raise NotImplementedError

    def prefill(self, text: str) -> dict:
        """Only computes `text` into the prefix cache (no new token); its meta_info."""
        raise NotImplementedError

    def prompt_logprobs(self, items: list[str] | list[list[int]], start: int) -> list[list[Row]]:
        """Per item (a text, or token ids), its prompt tokens' Rows from position `start` on."""
        raise NotImplementedError

    def choice_logprobs(self, prompt: str, choices: list[str], unconditional: bool):
        return score(prompt, choices, unconditional, lambda t: self.prefill(t)["prompt_tokens"],
                     self.prompt_logprobs)

    def flush_cache(self) -> None:
        raise BackendError(f"{type(self).__name__} cannot flush the server's prefix cache")
