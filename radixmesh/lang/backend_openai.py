"""Any OpenAI-compatible server over plain HTTP: /v1/completions (the contract: radixmesh/lang/backend.py).

Roles are text, as with the other backends: the program stays one growing prompt (its prefixes
shareable by a prefix cache) sent to /v1/completions, never /v1/chat/completions. The text around
each role comes from `role_format` (template.CHATML, ...) or, on a radixmesh server, is learnt from
its chat template; another server without `role_format` is an error (a guess would be silently wrong).

gen sends max_tokens, temperature, top_p, stop (and ignore_eos); regex and json_schema only to a
radixmesh server (its `regex` field and `response_format`), elsewhere they are refused. select needs
each choice's prompt logprobs, which the OpenAI API does not have: it asks for vLLM's
`prompt_logprobs` (radixmesh and vLLM answer it) and, from a server that ignores the field, raises
BackendError saying so."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

from radixmesh.lang import template
from radixmesh.lang.backend import Backend, BackendError, Row, sse_events
from radixmesh.lang.ir import Gen

NO_PROMPT_LOGPROBS = ("select needs each choice's prompt logprobs, which an OpenAI-compatible server does not give: "
                      "{url} answered /v1/completions without vLLM's prompt_logprobs{why}. Use a server that supports "
                      "prompt_logprobs (radixmesh, vLLM), or HttpBackend/GrpcBackend against radixmesh or SGLang.")


class OpenAIBackend(Backend):
    """`base_url` of the API (http://127.0.0.1:8000/v1); `model` defaults to the first of /v1/models."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", api_key: str | None = None,
                 model: str | None = None, timeout_s: float = 300.0,
                 role_format: template.RoleFormat | None = None) -> None:
        super().__init__(role_format)
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        models = self._call("GET", "/models")["data"]
        if model is None and not models:
            raise BackendError(f"{self.base_url}/models lists no model: pass model=")
        self.model = model or models[0]["id"]
        # radixmesh's gateway says so in /v1/models; it then takes regex, response_format and max_tokens 0
        self.radixmesh = any(m.get("owned_by") == "radixmesh" for m in models)

    # --- transport -----------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None, root: str | None = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request((root or self.base_url) + path, data, headers, method=method)

    def _call(self, method: str, path: str, body: dict | None = None, root: str | None = None):
        try:
            with urllib.request.urlopen(self._request(method, path, body, root), timeout=self.timeout_s) as resp:
                body = resp.read()  # JSON, but /flush_cache's "Cache flushed." (SGLang's)
                return json.loads(body) if resp.headers.get_content_type() == "application/json" else body.decode()
        except urllib.error.HTTPError as e:
            raise BackendError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None

    def completion_body(self, prompt, g: Gen) -> dict:
        """The /v1/completions body of a gen."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": g.max_tokens, "temperature": g.temperature}
        if g.top_p != 1.0:
            body["top_p"] = g.top_p
        if g.stop:
            body["stop"] = list(g.stop)
        if g.ignore_eos:
            body["ignore_eos"] = True
        if g.regex is not None or g.json_schema is not None:
            if not self.radixmesh:
                raise BackendError(f"gen(regex=, json_schema=) needs a radixmesh server; {self.base_url} is another "
                                   "OpenAI-compatible server, whose constrained-decoding fields differ")
            if g.regex is not None:
                body["regex"] = g.regex
            else:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "gen", "schema": json.loads(g.json_schema)}}
        return body

    # --- the backend contract --------------------------------------------------------
    def render(self, messages: list[dict]) -> str:
        if not self.radixmesh:
            raise BackendError(f"{self.base_url} cannot render its chat template over the OpenAI API: pass "
                               "OpenAIBackend(role_format=...), e.g. radixmesh.lang.template.CHATML")
        root = self.base_url.removesuffix("/v1")  # radixmesh's /tokenize and /v1/detokenize
        ids = self._call("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False}, root)["tokens"]
        return self._call("POST", "/detokenize", {"tokens": ids, "skip_special_tokens": False})["text"]

    def generate(self, text: str, g: Gen) -> tuple[str, dict]:
        obj = self._call("POST", "/completions", self.completion_body(text, g))
        return obj["choices"][0]["text"], meta_info(obj["choices"][0], obj.get("usage"))

    def generate_stream(self, text: str, g: Gen) -> Iterator[tuple[str, dict]]:
        body = {**self.completion_body(text, g), "stream": True, "stream_options": {"include_usage": True}}
        choice: dict = {}
        for event in sse_events(self._request("POST", "/completions", body), "POST /completions", self.timeout_s):
            if event.get("choices"):
                choice = {**choice, **{k: v for k, v in event["choices"][0].items() if v is not None}}
                yield event["choices"][0].get("text") or "", meta_info(choice, event.get("usage"))
            elif event.get("usage"):  # the usage chunk: no choices
                yield "", meta_info(choice, event["usage"])

    def prefill(self, text: str) -> dict:
        # max_tokens 0 computes only the prompt on radixmesh; other servers want at least one token
        return self.generate(text, Gen(max_tokens=0 if self.radixmesh else 1))[1]

    def prompt_logprobs(self, items: list[str] | list[list[int]], start: int) -> list[list[Row]]:
        body = {"model": self.model, "prompt": items, "max_tokens": 0 if self.radixmesh else 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        try:
            obj = self._call("POST", "/completions", body)
        except BackendError as e:  # a server that refuses the field
            raise BackendError(NO_PROMPT_LOGPROBS.format(url=self.base_url, why=f" ({e})")) from None
        choices = sorted(obj["choices"], key=lambda c: c["index"])
        if len(choices) != len(items) or any(c.get("prompt_logprobs") is None for c in choices):
            raise BackendError(NO_PROMPT_LOGPROBS.format(url=self.base_url, why=""))
        return [vllm_rows(c["prompt_logprobs"])[start:] for c in choices]

    def flush_cache(self) -> None:
        if not self.radixmesh:
            super().flush_cache()
        self._call("POST", "/flush_cache", {}, self.base_url.removesuffix("/v1"))


def vllm_rows(positions: list[dict | None]) -> list[Row]:
    """vLLM's prompt_logprobs (per position {token id: {logprob, rank, decoded_token}}, asked with k = 0: the
    prompt token alone; the first position null) as Rows."""
    out: list[Row] = []
    for p in positions:
        if not p:
            out.append([None, None, None])
            continue
        tid, entry = next(iter(p.items()))
        out.append([entry["logprob"], int(tid), entry.get("decoded_token")])
    return out


def meta_info(choice: dict, usage: dict | None) -> dict:
    """A completion choice and usage in SGLang's meta_info shape (as the other backends give it)."""
    usage = usage or {}
    reason = choice.get("finish_reason")
    return {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "finish_reason": None if reason is None else {"type": reason, "matched": choice.get("stop_reason")}}
