"""The drain deadline (SIGTERM, --drain-timeout-s) ends what is still running cleanly: an SSE
stream gets a `finish_reason: "abort"` chunk for each unfinished choice, then `data: [DONE]`;
a request with no answer started gets a 503 error. The backend stalls so nothing finishes
in time; its `aborted` shows the mesh request was aborted too."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

pytestmark = pytest.mark.timeout(60)
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "n": 2}
COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 50}


def post(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=30)


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("route, body, kind", [("/v1/chat/completions", CHAT, "chat.completion.chunk"),
                                               ("/v1/completions", COMPLETION, "text_completion")])
def test_a_stream_cut_off_at_the_drain_deadline_ends_with_aborts_then_done(route: str, body: dict, kind: str):
    backend = FakeBackend(stall_after_tokens=2)
    with GatewayThread(backend) as gw:
        resp = post(gw.url + route, {**body, "stream": True})
        first = resp.readline().decode()  # the stream is open
        gw.drain(0.3)
        got = events(first + resp.read().decode())
    assert got[-1] == "[DONE]"
    chunks = [json.loads(e) for e in got[:-1]]
    n = body.get("n", 1)
    ends = chunks[-n:]
    assert all(c["object"] == kind for c in chunks)
    assert sorted(c["choices"][0]["index"] for c in ends) == list(range(n))
    assert all(c["choices"][0]["finish_reason"] == "abort" for c in ends)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-n])
    end = ends[0]["choices"][0]
    assert (end["delta"] if kind.startswith("chat") else end["text"]) in ({}, "")  # nothing new, just the end
    assert backend.aborted == [c.rid for c in backend.calls]


@pytest.mark.parametrize("stream, stall", [(False, 1), (True, 0)])  # streamed: no event came, nothing sent
def test_a_request_not_answering_yet_at_the_drain_deadline_gets_503(stream: bool, stall: int):
    backend = FakeBackend(stall_after_tokens=stall)
    answer: dict = {}

    def call() -> None:
        try:
            post(gw.url + "/v1/completions", {**COMPLETION, "stream": stream})
        except urllib.error.HTTPError as e:
            answer.update(status=e.code, body=json.loads(e.read()))

    with GatewayThread(backend) as gw:
        client = threading.Thread(target=call)
        client.start()
        while not backend.active:
            time.sleep(0.01)
        gw.drain(0.3)
        client.join(10)
    assert answer["status"] == 503, answer
    assert answer["body"]["error"]["code"] == "shutting_down"
    assert backend.aborted == [c.rid for c in backend.calls]
