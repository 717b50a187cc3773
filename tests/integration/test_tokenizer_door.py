"""The tokenizer service as a gRPC front door, over real gRPC on loopback: the real
TokenizerService and DetokenizerService (the default model's tokenizer) in front of a
scripted scheduler that records what reaches it and streams chosen token ids.

- Request limits: the same table of bad inputs gets INVALID_ARGUMENT from the tokenizer's
  Generate (before anything reaches the scheduler) and HTTP 400 from the gateway in front.
- Stop strings wait for min_new_tokens on the mesh path (scheduler -> detokenizer -> tokenizer),
  as they do in the Engine.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc, worker_pb2
from protos.radixmesh.v2 import detokenizer_pb2_grpc as detokenizer2_grpc
from protos.radixmesh.v2 import outputs_pb2 as opb
from protos.radixmesh.v2 import scheduler_pb2 as spb2
from protos.radixmesh.v2 import scheduler_pb2_grpc as scheduler2_grpc
from protos.radixmesh.v2 import tokenizer_pb2 as pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common.server import Readiness
from services.detokenizer.service import DetokenizerService, TextsServicer
from services.gateway.app import build_app
from services.gateway.backend import GrpcBackend
from services.gateway.config import GatewayConfig
from services.tokenizer.main import TokenizerServiceConfig
from services.tokenizer.service import TokenizerService, TokenizerV2


@dataclass
class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """radixmesh.v1's info and stats; `scripted_v2` answers v2's Submit by streaming `tokens`
    on its Outputs, one per step (the last with a LENGTH finish). Records what it got."""
    vocab_size: int
    tokens: list[int] = field(default_factory=list)
    requests: list = field(default_factory=list)
    aborts: list = field(default_factory=list)

    async def GetInfo(self, request, context):
        return worker_pb2.WorkerInfo(model=worker_pb2.ModelConfig(
            vocab_size=self.vocab_size, max_position_embeddings=2048, name="scripted"), num_kv_pages=4096, page_size=1)

    async def GetStats(self, request, context):
        return scheduler_pb2.SchedulerStats(worker_connected=True)


@dataclass
class ScriptedV2(scheduler2_grpc.SchedulerServicer):
    """Steps like a scheduler: each step's one OutputBatch holds the next token of every
    running request (the first output carrying its text options, the last its LENGTH finish)."""
    script: ScriptedScheduler
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    running: dict = field(default_factory=dict)  # rid -> [request, its tokens, tokens sent]
    stepping: asyncio.Task | None = None

    async def Submit(self, request, context):
        self.script.requests.append(request)
        self.running[request.rid] = [request, list(self.script.tokens), 0]
        if self.stepping is None or self.stepping.done():
            self.stepping = asyncio.get_running_loop().create_task(self._steps())
        return spb2.SubmitResponse()

    async def _steps(self) -> None:
        while self.running:
            await asyncio.sleep(0.005)
            batch = opb.OutputBatch()
            for rid, entry in list(self.running.items()):
                request, tokens, i = entry
                out = opb.SequenceOutput(rid=rid, index=0, token_ids=[tokens[i]], usage=cpb.Usage(
                    prompt_tokens=len(request.input_ids), completion_tokens=i + 1))
                if i == 0:
                    out.text_options.CopyFrom(request.text_options)
                    out.text_options.stop.extend(request.sampling.stop)
                entry[2] = i + 1
                if i + 1 == len(tokens):
                    out.finish.CopyFrom(cpb.Finish(index=0, finish_reason=cpb.FINISH_REASON_LENGTH))
                    del self.running[rid]
                batch.outputs.append(out)
            self.outputs.put_nowait(batch)

    async def Abort(self, request, context):
        self.script.aborts.append(request)
        entry = self.running.pop(request.rid, None)
        if entry is not None and not request.as_stop:  # the abort's finish, as the core sends it
            self.outputs.put_nowait(opb.OutputBatch(outputs=[opb.SequenceOutput(
                rid=request.rid, index=0, finish=cpb.Finish(index=0, finish_reason=cpb.FINISH_REASON_ABORT))]))
        return spb2.AbortResponse(found=entry is not None)

    async def Outputs(self, request, context):
        await context.send_initial_metadata(())
        while True:
            yield await self.outputs.get()


async def serve(add, servicer, *more) -> tuple[grpc.aio.Server, str]:
    """more: (add, servicer) pairs served beside it."""
    server = grpc.aio.server()
    for add_one, one in ((add, servicer), *more):
        add_one(one, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@dataclass
class Door:
    scheduler: ScriptedScheduler
    address: str
    channel: grpc.aio.Channel
    tokenizer: object

    @property
    def stub(self) -> tokenizer_pb2_grpc.TokenizerStub:
        return tokenizer_pb2_grpc.TokenizerStub(self.channel)


@pytest.fixture
async def door(tokenizer):
    sched = ScriptedScheduler(vocab_size=tokenizer.vocab_size)
    sched_server, sched_addr = await serve(scheduler_pb2_grpc.add_SchedulerServicer_to_server, sched,
                                           (scheduler2_grpc.add_SchedulerServicer_to_server, ScriptedV2(sched)))
    detok = DetokenizerService(tokenizer)
    texts = TextsServicer(detok, Readiness())
    texts.start(sched_addr)
    detok_server, detok_addr = await serve(detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, detok,
                                           (detokenizer2_grpc.add_DetokenizerServicer_to_server, texts))
    service = TokenizerService(TokenizerServiceConfig(scheduler_addr=sched_addr, detokenizer_addr=detok_addr,
                                                      peer_wait_s=30))
    await service.start()
    tok_server, tok_addr = await serve(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, service,
                                       (tokenizer2_grpc.add_TokenizerServicer_to_server, TokenizerV2(service)))
    channel = grpc.aio.insecure_channel(tok_addr)
    try:
        yield Door(sched, tok_addr, channel, tokenizer)
    finally:
        await channel.close()
        texts._task.cancel()
        for server in (tok_server, detok_server, sched_server):
            await server.stop(0)


# --- one table, two doors ---------------------------------------------------------------------

# (case, native sampling fields, n, rid, top_logprobs, a word the message must hold)
BAD = [
    ("17 stop strings", dict(stop=[f"s{i}" for i in range(17)]), 1, "", 0, "stop"),
    ("100,000 stop strings", dict(stop=["s"] * 100_000), 1, "", 0, "stop"),
    ("an empty stop string", dict(stop=["ok", ""]), 1, "", 0, "stop"),
    ("65 stop_token_ids", dict(stop_token_ids=list(range(65))), 1, "", 0, "stop_token_ids"),
    ("n = 17", {}, 17, "", 0, "n"),
    ("n = 0", {}, 0, "", 0, "n"),
    ("repetition_penalty 11", dict(repetition_penalty=11.0), 1, "", 0, "repetition_penalty"),
    ("top_logprobs 21", {}, 1, "", 21, "logprobs"),
    ("temperature -1", dict(temperature=-1.0), 1, "", 0, "temperature"),
    ("min > max", dict(max_new_tokens=2, min_new_tokens=3), 1, "", 0, "min_new_tokens"),
    ("a stop token outside the vocabulary", dict(stop_token_ids=[10**6]), 1, "", 0, "stop_token_ids"),
    ("a 129-character rid", {}, 1, "r" * 129, 0, "rid"),
]
IDS = [case[0] for case in BAD]


def grpc_request(fields: dict, n: int, rid: str, top: int) -> pb.GenerateTextRequest:
    sampling = cpb.SamplingParams(**{"max_new_tokens": 4, **fields})
    if top:
        sampling.logprobs, sampling.top_logprobs = True, top
    req = pb.GenerateTextRequest(text="Hello", sampling=sampling, rid=rid)
    if n != 1:
        req.n = n
    return req


def http_body(fields: dict, n: int, rid: str, top: int) -> dict:
    params = {"max_new_tokens": 4, **fields, **({"n": n} if n != 1 else {})}
    body = {"text": "Hello", "sampling_params": params}
    if rid:
        body["rid"] = rid
    if top:
        body["return_logprob"], body["top_logprobs_num"] = True, top
    return body


@pytest.mark.parametrize("case,fields,n,rid,top,word", BAD, ids=IDS)
async def test_grpc_generate_refuses_what_http_refuses(door, case, fields, n, rid, top, word):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in door.stub.Generate(grpc_request(fields, n, rid, top), timeout=30):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert word in e.value.details()
    assert door.scheduler.requests == []  # refused at the door


async def test_http_refuses_the_same_table(door):
    app = build_app(GatewayConfig(tokenizer_addr=door.address), GrpcBackend(door.address))
    async with TestClient(TestServer(app)) as client:
        for case, fields, n, rid, top, word in BAD:
            r = await client.post("/generate", json=http_body(fields, n, rid, top))
            assert r.status == 400, (case, await r.text())
            assert word in (await r.json())["error"]["message"], case
        assert door.scheduler.requests == []
        door.scheduler.tokens = door.tokenizer.encode(" fine", add_special_tokens=False)
        ok = await client.post("/generate", json=http_body(dict(stop=[f"s{i}" for i in range(16)]), 1, "", 0))
        assert ok.status == 200, await ok.text()  # at the limits: served
    assert len(door.scheduler.requests) == 1


# --- min_new_tokens on the mesh path -----------------------------------------------------------

async def run(door: Door, sampling: cpb.SamplingParams) -> tuple[str, cpb.Finish | None]:
    text, finish = "", None
    async for ev in door.stub.Generate(pb.GenerateTextRequest(text="Hello", sampling=sampling), timeout=30):
        kind = ev.WhichOneof("event")
        assert kind != "error", ev.error
        if kind == "chunk":
            text += ev.chunk.text
        elif kind == "finish":
            finish = ev.finish
    return text, finish


async def test_a_stop_string_does_not_end_the_request_before_min_new_tokens(door):
    pieces = [" one", ".", " two", ".", " three", "."]
    door.scheduler.tokens = [t for p in pieces for t in door.tokenizer.encode(p, add_special_tokens=False)]
    full = door.tokenizer.decode(door.scheduler.tokens)
    first_dot = full.index(".")
    k = len(door.tokenizer.encode(full[:first_dot + 1], add_special_tokens=False))  # tokens through the first "."

    text, finish = await run(door, cpb.SamplingParams(max_new_tokens=32, stop=["."]))
    assert text == full[:first_dot] and finish.stop_str == "."  # without min_new_tokens: the first "."

    text, finish = await run(door, cpb.SamplingParams(max_new_tokens=32, stop=["."], min_new_tokens=k))
    second_dot = full.index(".", first_dot + 1)
    assert text == full[:second_dot] and finish.stop_str == "."  # the first "." came too early
    assert finish.finish_reason == cpb.FINISH_REASON_STOP

    text, finish = await run(door, cpb.SamplingParams(max_new_tokens=32, stop=["."],
                                                      min_new_tokens=len(door.scheduler.tokens)))
    assert text == full and finish.finish_reason == cpb.FINISH_REASON_LENGTH


# --- many requests on one GenerateStream call (what the gateway uses) -----------------------------

async def test_generate_stream_carries_many_requests_refusals_and_cancels(door):
    door.scheduler.tokens = door.tokenizer.encode(" one two three four", add_special_tokens=False)
    stub = tokenizer2_grpc.TokenizerStub(door.channel)
    outbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (msg := await outbox.get()) is not None:
            yield msg

    def generate(rid: str, **sampling) -> pb2.StreamRequest:
        return pb2.StreamRequest(generate=pb.GenerateTextRequest(
            rid=rid, text="Hello", sampling=cpb.SamplingParams(max_new_tokens=8, **sampling)))

    call = stub.GenerateStream(requests())
    for msg in (generate("a"), generate("b"), generate("bad", temperature=-1.0), generate("")):
        outbox.put_nowait(msg)
    texts: dict[str, str] = {"a": "", "b": ""}
    finished, errors, batches_with_both = set(), {}, 0
    async for batch in call:
        rids = {out.rid for out in batch.outputs}
        batches_with_both += rids == {"a", "b"}
        for out in batch.outputs:
            texts[out.rid] += out.text
            if out.HasField("finish"):
                finished.add(out.rid)
        errors.update({e.rid: e.error for e in batch.errors})
        if finished == {"a", "b"} and {"bad", ""} <= errors.keys():
            break
    assert texts == {"a": " one two three four", "b": " one two three four"}
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in errors["bad"].message
    assert errors[""].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "rid" in errors[""].message
    assert batches_with_both > 0  # one message carried both requests' outputs of a step

    door.scheduler.tokens = door.tokenizer.encode(" and so on" * 40, add_special_tokens=False)
    outbox.put_nowait(generate("long", ignore_eos=True))
    async for batch in call:
        if any(out.rid == "long" for out in batch.outputs):
            outbox.put_nowait(pb2.StreamRequest(cancel="long"))
            break
    for _ in range(100):  # the cancel reaches the scheduler as an abort of the request
        if any(a.rid == "long" for a in door.scheduler.aborts):
            break
        await asyncio.sleep(0.05)
    assert any(a.rid == "long" and not a.as_stop for a in door.scheduler.aborts)
    outbox.put_nowait(None)
    call.cancel()
