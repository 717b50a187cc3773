"""radixmesh (or SGLang) over HTTP: the native /generate, in SGLang's shapes (the contract:
radixmesh/lang/backend.py)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

from radixmesh.lang import template
from radixmesh.lang.backend import Backend, BackendError, sse_events
from radixmesh.lang.ir import Gen


class HttpBackend(Backend):
    """`base_url` of a radixmesh gateway (`make serve`: http://127.0.0.1:8000) or an SGLang server."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout_s: float = 300.0, role_format: template.RoleFormat | None = None) -> None:
        super().__init__(role_format)
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model_info = self._call("GET", "/get_model_info")

    # --- transport -----------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(self.base_url + path, data, headers, method=method)

    def _call(self, method: str, path: str, body: dict | None = None):
        try:
            with urllib.request.urlopen(self._request(method, path, body), timeout=self.timeout_s) as resp:
                body = resp.read()  # JSON, but /flush_cache's "Cache flushed." (SGLang's)
                return json.loads(body) if resp.headers.get_content_type() == "application/json" else body.decode()
        except urllib.error.HTTPError as e:
            raise BackendError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None

    def generate_raw(self, body: dict):
        return self._call("POST", "/generate", body)

    # --- the backend contract --------------------------------------------------------
    def render(self, messages: list[dict]) -> str:
        ids = self._call("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False})["tokens"]
        return self._call("POST", "/v1/detokenize", {"tokens": ids, "skip_special_tokens": False})["text"]

    def generate(self, text: str, g: Gen) -> tuple[str, dict]:
        obj = self.generate_raw({"text": text, "sampling_params": g.sampling_params()})
        return obj["text"], obj["meta_info"]

    def generate_stream(self, text: str, g: Gen) -> Iterator[tuple[str, dict]]:
        body = {"text": text, "sampling_params": g.sampling_params(), "stream": True}
        sent = 0
        for event in sse_events(self._request("POST", "/generate", body), "POST /generate", self.timeout_s):
            piece = event["text"][sent:]  # SGLang's events carry the text so far
            sent = len(event["text"])
            yield piece, event["meta_info"]

    def prefill(self, text: str) -> dict:
        """Only computes `text` into the prefix cache (max_new_tokens 0)."""
        return self.generate_raw({"text": text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]

    def prompt_logprobs(self, items, start):
        key = "text" if isinstance(items[0], str) else "input_ids"
        objs = self.generate_raw({key: items, "sampling_params": {"max_new_tokens": 0},
                                  "return_logprob": True, "logprob_start_len": start})
        return [o["meta_info"]["input_token_logprobs"] for o in objs]

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache", {})
