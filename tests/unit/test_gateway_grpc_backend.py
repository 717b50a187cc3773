"""GrpcBackend against an in-process stub Tokenizer over real gRPC on loopback:
request conversion, event and status mapping, readiness, and cancellation of
the call when the HTTP client goes away."""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.convert import sampling_from_proto
from services.common.sampling_params import SamplingParams
from services.gateway.app import build_app
from services.common.outputs import FinishReason, RequestOutput
from services.gateway.backend import BackendError, GenerateCall, GrpcBackend
from services.gateway.config import GatewayConfig
from tests.doubles.v2_generate import add_both


class StubTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self) -> None:
        self.requests: list[tokenizer_pb2.GenerateTextRequest] = []
        self.cancelled = asyncio.Event()
        self.ready = True
        self.mode = "ok"  # ok | invalid | full | error_event | slow
        self.slow_tokens = 1000  # chunks in "slow" mode, 50 ms apart

    async def Info(self, request, context):
        return tokenizer_pb2.InfoResponse(model_name="stub", vocab_size=100, context_length=64,
                                          eos_token_ids=[0], has_chat_template=True)

    async def Ready(self, request, context):
        stages = [tokenizer_pb2.StageHealth(stage="scheduler", address="x:1", serving=self.ready,
                                            detail="" if self.ready else "worker not connected")]
        return tokenizer_pb2.ReadyResponse(ready=self.ready, stages=stages)

    async def Generate(self, request, context):
        self.requests.append(request)
        # `cancelled` is set when the call ends before this handler did. Neither a CancelledError
        # here (one that lands while grpc writes a chunk is raised there, not in this generator)
        # nor grpc.aio's context.cancelled() (False on the server) tells that reliably.
        loop, answered = asyncio.get_running_loop(), False

        def on_done(_context) -> None:
            if not answered and not loop.is_closed():
                loop.call_soon_threadsafe(self.cancelled.set)

        context.add_done_callback(on_done)
        if self.mode in ("invalid", "full"):
            answered = True
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt (70 tokens) exceeds the context")
        if self.mode == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        for i in range(3 if self.mode != "slow" else self.slow_tokens):
            lp = common_pb2.TokenLogprob(token_id=5 + i, logprob=-0.5, token=f" t{i}",
                                         token_bytes=f" t{i}".encode(), top=[
                common_pb2.TokenLogprob.Top(token_id=5 + i, logprob=-0.5, token=f" t{i}",
                                            token_bytes=f" t{i}".encode()),
                common_pb2.TokenLogprob.Top(token_id=8, logprob=-1.0, token="bytes:\\xe6",
                                            token_bytes=b"\xe6"),  # a piece of a character
                common_pb2.TokenLogprob.Top(token_id=9, logprob=-2.0)])  # no text: token_id:9
            yield common_pb2.GenerateResponse(chunk=common_pb2.GenerateChunk(
                index=0, token_ids=[5 + i], text=f" t{i}", logprobs=[lp], prompt_tokens=4,
                completion_tokens=i + 1, cached_tokens=2))
            if self.mode == "slow":
                await asyncio.sleep(0.05)
        if self.mode == "error_event":
            answered = True
            yield common_pb2.GenerateResponse(error=common_pb2.Error(
                code=grpc.StatusCode.INTERNAL.value[0], message="worker died"))
            return
        answered = True
        yield common_pb2.GenerateResponse(finish=common_pb2.Finish(
            index=0, finish_reason=common_pb2.FINISH_REASON_STOP, stop_str="###"))


@contextlib.asynccontextmanager
async def stub_server(serving: bool = True):
    stub = StubTokenizer()
    server = grpc.aio.server()
    add_both(stub, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if serving
                              else health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    backend = GrpcBackend(f"127.0.0.1:{port}", probe_timeout_s=2)
    try:
        yield stub, backend, health_servicer
    finally:
        await backend.close()
        await server.stop(0)


async def test_request_conversion_and_events():
    async with stub_server() as (stub, backend, _):
        sp = SamplingParams(max_new_tokens=3, temperature=0.0, stop=["###"], seed=4, logprobs=True, top_logprobs=1)
        calls = [GenerateCall("r1", sp, n=2, text="hello"),
                 GenerateCall("r2", sp, messages=[{"role": "user", "content": "hi", "name": "bob"}]),
                 GenerateCall("r3", sp, input_ids=[1, 2, 3], include_stop_str_in_output=True),
                 GenerateCall("r4", sp, text="no max_tokens", fill_context=True),
                 GenerateCall("r5", sp, text="no max_tokens, capped", fill_context=True, fill_cap=7)]
        events = []
        for c in calls:
            events.append([e async for batch in backend.generate(c) for e in batch])
        info = await backend.info()
    text, chat, ids, fill, capped = stub.requests
    assert text.sampling.HasField("max_new_tokens") and not text.HasField("default_max_new_tokens")
    assert not fill.sampling.HasField("max_new_tokens") and not fill.HasField("default_max_new_tokens")
    assert fill.sampling.temperature == 0.0 and fill.sampling.seed == 4  # the rest is still sent
    assert not capped.sampling.HasField("max_new_tokens") and capped.default_max_new_tokens == 7
    assert text.text == "hello" and text.rid == "r1" and text.n == 2 and text.skip_special_tokens
    assert chat.conversation.messages[0].name == "bob" and chat.conversation.messages[0].content == "hi"
    assert list(ids.input_ids.ids) == [1, 2, 3] and ids.include_stop_str_in_output
    assert sampling_from_proto(text.sampling) == SamplingParams(max_new_tokens=3, temperature=0.0, stop=["###"],
                                                                seed=4, logprobs=True, top_logprobs=1)
    *chunks, finish = events[0]
    assert [c.text for c in chunks] == [" t0", " t1", " t2"] and not chunks[0].finished
    assert chunks[-1].completion_tokens == 3 and chunks[0].cached_tokens == 2
    assert chunks[0].logprobs[0].token_id == 5 and chunks[0].logprobs[0].top[0].logprob == -0.5
    assert chunks[1].logprobs[0].token == " t1" and chunks[1].logprobs[0].bytes == b" t1"
    assert [(t.token, t.bytes) for t in chunks[1].logprobs[0].top] == [
        (" t1", b" t1"), ("bytes:\\xe6", b"\xe6"), (None, None)]
    assert finish == RequestOutput("r1", index=0, finished=True, finish_reason=FinishReason.STOP, matched_stop="###")
    assert (info.name, info.vocab_size, info.context_length) == ("stub", 100, 64)


@pytest.mark.parametrize("mode,code", [("invalid", "INVALID_ARGUMENT"), ("full", "RESOURCE_EXHAUSTED"),
                                       ("error_event", "INTERNAL")])
async def test_failures_become_backend_errors(mode, code):
    async with stub_server() as (stub, backend, _):
        stub.mode = mode
        with pytest.raises(BackendError) as e:
            async for _ in backend.generate(GenerateCall("r", SamplingParams(), text="x")):
                pass
    assert e.value.code == code


async def test_readiness_reasons():
    async with stub_server(serving=False) as (stub, backend, health_servicer):
        not_serving = await backend.not_ready()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ok = await backend.not_ready()
        stub.ready = False
        stage_down = await backend.not_ready()
    down = GrpcBackend("127.0.0.1:1", probe_timeout_s=1)
    unreachable = await down.not_ready()
    with pytest.raises(BackendError) as e:
        async for _ in down.generate(GenerateCall("r", SamplingParams(), text="x")):
            pass
    await down.close()
    assert "not serving" in not_serving and ok is None
    assert "scheduler at x:1: worker not connected" in stage_down
    assert "does not answer: UNAVAILABLE" in unreachable and e.value.code == "UNAVAILABLE"


async def test_gateway_maps_grpc_statuses_and_cancels_on_disconnect():
    async with stub_server() as (stub, backend, _):
        app = build_app(GatewayConfig(), backend, monitor_backend=False)
        async with TestClient(TestServer(app)) as client:
            body = {"model": "stub", "prompt": "x", "max_tokens": 4}
            statuses = {}
            for mode in ("invalid", "full", "ok"):
                stub.mode = mode
                r = await client.post("/v1/completions", json=body)
                statuses[mode] = (r.status, r.headers.get("Retry-After"), (await r.json()))
            stub.mode = "slow"
            with pytest.raises(asyncio.TimeoutError):
                async with client.post("/v1/completions", json={**body, "stream": True},
                                       timeout=aiohttp.ClientTimeout(total=0.4)) as r:
                    await r.read()
            await asyncio.wait_for(stub.cancelled.wait(), 5)
    assert statuses["invalid"][0] == 400 and "exceeds the context" in statuses["invalid"][2]["error"]["message"]
    assert statuses["full"][:2] == (503, "1")
    ok = statuses["ok"][2]
    assert ok["choices"][0]["text"] == " t0 t1 t2" and ok["choices"][0]["matched_stop"] == "###"
    assert ok["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                           "prompt_tokens_details": {"cached_tokens": 2}}


async def test_logprob_token_strings_reach_both_openai_shapes():
    async with stub_server() as (_, backend, _):
        app = build_app(GatewayConfig(), backend, monitor_backend=False)
        async with TestClient(TestServer(app)) as client:
            chat = await (await client.post("/v1/chat/completions", json={
                "model": "stub", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                "logprobs": True, "top_logprobs": 3})).json()
            comp = await (await client.post("/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 3,
                                                                      "logprobs": 3})).json()
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == " t0" and first["bytes"] == list(b" t0")
    assert [(t["token"], t["bytes"]) for t in first["top_logprobs"]] == [
        (" t0", list(b" t0")), ("bytes:\\xe6", [0xe6]), ("token_id:9", None)]
    lp = comp["choices"][0]["logprobs"]
    assert lp["tokens"] == [" t0", " t1", " t2"] and lp["text_offset"] == [0, 3, 6]
    assert lp["top_logprobs"][2] == {" t2": -0.5, "bytes:\\xe6": -1.0, "token_id:9": -2.0}
