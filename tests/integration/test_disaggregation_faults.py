"""Prefill/decode disaggregation when a replica dies: the other side notices within seconds,
names the failure, and gives back every page the request held (its own module, so that no other
replica shares the machine while these start and kill theirs)."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from tests.integration.mesh_harness import collect, finish_reason
from tests.integration.test_disaggregation_mesh import SYSTEM, bootstrap, meshes, paired, private_pages, request, settle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas():
    """Two prefill replicas and one decode replica: the first test kills one prefill side, the
    second pairs the other with the decode side and kills that."""
    started = meshes("prefill", "prefill", "decode", extra=("--disaggregation-timeout-s", "10"))
    yield started
    for mesh in started:
        mesh.kill_all()


def long_pair(prefill, decode):
    """A ~1,000-token prompt (many 64-token chunks) to both sides; (prefill call, decode call)."""
    to_prefill, to_decode = paired(request(SYSTEM * 4 + "Summarize.", max_new_tokens=8), bootstrap(prefill))
    return (prefill.tokenizer().Generate(to_prefill, timeout=60),
            decode.tokenizer().Generate(to_decode, timeout=60))


def wait_reserved(*sides, timeout: float = 30) -> None:
    """Until every side holds private pages (computing, or reserved for the KV to come)."""
    deadline = time.monotonic() + timeout
    while any(private_pages(m) == 0 for m in sides) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_prefill_side_that_dies_mid_transfer_fails_the_request_and_frees_the_decode_pages(replicas):
    prefill, _, decode = replicas
    prefill_call, decode_call = long_pair(prefill, decode)
    wait_reserved(prefill, decode)
    os.kill(prefill.pids["worker"], signal.SIGKILL)
    t0 = time.monotonic()
    got = collect(decode_call)
    code, message = got[-1]["error"]
    assert code == grpc.StatusCode.UNAVAILABLE.value[0]  # nothing streamed: the router may retry the pair
    assert "prefill side" in message
    assert time.monotonic() - t0 < 15  # noticed within seconds
    assert settle(decode) == [0]
    prefill_call.cancel()


def test_a_decode_side_that_dies_frees_the_prefill_pages(replicas):
    _, prefill, decode = replicas
    prefill_call, _ = long_pair(prefill, decode)  # the decode call is never read
    wait_reserved(prefill, decode)
    os.kill(prefill.pids["worker"], signal.SIGSTOP)  # mid-prompt: the rest of its pages still to cross
    try:
        decode.kill_all()  # the whole decode replica: its scheduler's Attach call and its worker
    finally:
        os.kill(prefill.pids["worker"], signal.SIGCONT)
    t0 = time.monotonic()
    got = collect(prefill_call)
    # its Attach call broke (the request is aborted) or a send found nobody (it fails): never Done
    aborted = 0 in got and finish_reason(got[0]["finish"]) == "abort"
    assert aborted or got.get(-1, {}).get("error", (0,))[0] == grpc.StatusCode.INTERNAL.value[0], got
    assert time.monotonic() - t0 < 15  # a broken call or a failed send: seconds, not a timeout
    assert settle(prefill) == [0]
