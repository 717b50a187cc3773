"""The tokenizer service: the replica's entry point.

Tokenize / ApplyChatTemplate / Info answer from the model's tokenizer. Generate
(radixmesh.v2, and radixmesh.v1 converted from it) validates and tokenizes the
prompt and submits it to the scheduler; its outputs come back one way, scheduler →
detokenizer → here, on the one Texts stream this service holds
(services/tokenizer/subscription.py), one message per step for all requests.
Tokenizing runs on a thread (long prompts take milliseconds); the template and the
vocabulary come from --model, the model facts (name, context length, eos ids) from
the scheduler's GetInfo, which start() waits for, and the Texts subscription, so
SERVING means the path behind is up.

Observability: a `tokenize` span and the tokenize time per Generate; calls to
the scheduler and detokenizer carry the trace (services/common/tracing.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

import grpc
import jinja2
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc, worker_pb2
from protos.radixmesh.v2 import outputs_pb2 as opb
from protos.radixmesh.v2 import scheduler_pb2 as spb2
from protos.radixmesh.v2 import scheduler_pb2_grpc as scheduler2_grpc
from protos.radixmesh.v2 import tokenizer_pb2 as pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common import metrics as prom
from services.common import tracing
from services.common.batches import drain_batches
from services.common.convert import sampling_from_proto
from services.common.logging import request_context
from services.common.refusal import Refused
from services.common.request_limits import check_request_limits
from services.common.sampling_params import InvalidRequest
from services.common.side_calls import SideCalls
from services.common.text_options import CONTEXT_IDS
from services.tokenizer.subscription import TextSubscription
from services.tokenizer.text_tokenizer import load_tokenizer
from services.common.tool_formats.base import ToolFormat
from services.common.tool_formats.registry import tool_format
from services.tokenizer.tool_prompt import inline_tools, native_format, template_takes_tools

log = logging.getLogger(__name__)


def messages_from_proto(conv: pb.Conversation) -> list[dict]:
    out = []
    for m in conv.messages:
        msg = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            msg["name"] = m.name
        if m.HasField("tool_call_id"):
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls_json:
            msg["tool_calls"] = _json_list(m.tool_calls_json, "tool_calls_json")
        out.append(msg)
    return out


def tools_from_proto(conv: pb.Conversation) -> list[dict] | None:
    return _json_list(conv.tools_json, "tools_json") if conv.tools_json else None


def tool_format_from_proto(conv: pb.Conversation) -> ToolFormat:
    try:
        return tool_format(conv.tool_call_format)
    except ValueError as e:
        raise InvalidRequest(f"tool_call_format: {e}") from None


def _json_list(text: str, name: str) -> list:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a JSON list")
    return value


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, config) -> None:  # a TokenizerServiceConfig
        self.config = config
        self.tokenizer = None
        self.model_info: worker_pb2.WorkerInfo | None = None
        self.subscription = TextSubscription()
        self._aborts = SideCalls("abort at the scheduler")
        self._muxes: set[asyncio.Queue] = set()  # the output queues of the open GenerateStream calls
        r = self.registry = CollectorRegistry()
        self._requests = prom.counter(r, "tokenizer_requests", "Generate calls accepted")
        self._tokenize_time = prom.histogram(r, "tokenize_seconds", "prompt → ids (chat template included)",
                                          prom.LATENCY_BUCKETS)
        r.register(prom.LiveCollector(lambda: self.model_info.model.name if self.model_info else None, lambda: {
            "tokenizer_active_requests": ("gauge", "Generate calls streaming now", len(self._active))}))

    @property
    def _active(self) -> dict:
        return self.subscription.streams

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
        self._sched_channel = tracing.channel(self.config.scheduler_addr)
        self._detok_channel = tracing.channel(self.config.detokenizer_addr)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._sched_channel)
        self.scheduler2 = scheduler2_grpc.SchedulerStub(self._sched_channel)
        self._detok_health = health_pb2_grpc.HealthStub(self._detok_channel)
        deadline = time.monotonic() + self.config.peer_wait_s
        self.model_info = await _retry(lambda: self.scheduler.GetInfo(worker_pb2.GetInfoRequest(), timeout=5),
                                       deadline, f"scheduler {self.config.scheduler_addr}")
        await _retry(self._detokenizer_serving, deadline, f"detokenizer {self.config.detokenizer_addr}")
        self._follow = asyncio.get_running_loop().create_task(
            self.subscription.follow(self.config.detokenizer_addr, self._detok_channel), name="texts-subscription")
        try:
            await asyncio.wait_for(self.subscription.connected.wait(), max(deadline - time.monotonic(), 5))
        except TimeoutError:
            raise RuntimeError(f"detokenizer {self.config.detokenizer_addr}: no outputs subscription "
                               f"({self.subscription.down_reason})") from None
        log.info("peers ready", extra={"model": self.model_info.model.name})

    async def _detokenizer_serving(self) -> None:
        resp = await self._detok_health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            raise ConnectionError(f"detokenizer is {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")

    async def drain(self, deadline: float) -> None:
        """Let streams finish; shortly before the deadline abort the rest at the scheduler,
        so they end with FINISH_REASON_ABORT instead of being cut."""
        margin = min(2.0, 0.25 * self.config.common.drain_timeout_s)
        while self._active and time.monotonic() < deadline - margin:
            await asyncio.sleep(0.05)
        if self._active:
            log.warning("drain: aborting requests", extra={"requests": len(self._active)})
            await asyncio.gather(*(self.scheduler2.Abort(spb2.AbortRequest(rid=rid), timeout=2)
                                   for rid in list(self._active)), return_exceptions=True)
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for mux in self._muxes:  # end the GenerateStream calls: long-lived, they would hold the drain
            mux.put_nowait(None)
        if getattr(self, "_follow", None) is not None:
            self._follow.cancel()

    # --- RPCs ------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateTextRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GenerateResponse]:
        """radixmesh.v1: the v2 stream, each output as a chunk (finish copied) then its Finish."""
        async for resp in self.generate(request, context):
            if resp.HasField("error"):
                yield cpb.GenerateResponse(error=resp.error)
                return
            for event in v1_events(resp):
                yield event

    async def generate(self, request: pb.GenerateTextRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb2.GenerateResponse]:
        """radixmesh.v2's Generate: admit; then the request's outputs, every output queued since
        the last message in one message."""
        try:
            stream = await self.admit(request)
        except Refused as e:
            await context.abort(e.code, e.message)
        try:
            while stream.open:
                resp = pb2.GenerateResponse()
                for item in await stream.take():
                    if isinstance(item, cpb.Error):
                        stream.open.clear()
                        yield pb2.GenerateResponse(error=item)
                        return
                    resp.outputs.append(item)
                    if item.HasField("finish"):
                        stream.open.discard(item.index)
                yield resp
        finally:  # done, failed or cancelled by the client: nothing stays open downstream
            self.end(stream)

    async def admit(self, request: pb.GenerateTextRequest, mux: asyncio.Queue | None = None):
        """Validate, tokenize, submit to the scheduler: the request's RequestStream, registered
        before it is submitted (its outputs go to `mux` when given: a GenerateStream call's).
        Raises Refused with the code the call fails with."""
        rid = request.rid or uuid.uuid4().hex
        if rid in self._active:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use")
        n = request.n if request.HasField("n") else 1
        try:
            self._check(request, rid)
            t0 = time.monotonic()
            with request_context(rid), tracing.tracer().start_as_current_span("tokenize") as span:
                ids = await self._prompt_ids(request)
                span.set_attribute("gen_ai.usage.input_tokens", len(ids))
            self._tokenize_time.labels(self.model_info.model.name).observe(time.monotonic() - t0)
            if not request.sampling.HasField("max_new_tokens"):
                cap = (request.default_max_new_tokens if request.HasField("default_max_new_tokens")
                       else self.config.default_max_tokens)
                request.sampling.max_new_tokens = fill_max_new_tokens(len(ids), self._token_room(), cap)
        except InvalidRequest as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if not self.subscription.connected.is_set():
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"no outputs path: {self.subscription.down_reason}")
        if rid in self._active:  # taken while this one was tokenized
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use")
        stream = self.subscription.open(rid, n, mux)
        try:
            await self.scheduler2.Submit(self._submit_request(rid, ids, request), timeout=30)
        except grpc.aio.AioRpcError as e:  # refused: the scheduler's code
            stream.open.clear()
            self.subscription.close(rid)
            raise Refused(e.code(), e.details() or e.code().name) from None
        self._requests.labels(self.model_info.model.name).inc()
        return stream

    def end(self, stream) -> None:
        """The request's reader is gone (done, failed, cancelled): forget it; abort what is open."""
        if self._active.get(stream.rid) is stream:
            self.subscription.close(stream.rid)
        if stream.open:
            stream.open.clear()
            self._aborts.start(self.scheduler2.Abort(spb2.AbortRequest(rid=stream.rid), timeout=10))

    async def generate_stream(self, request_iterator, context: grpc.aio.ServicerContext):
        """radixmesh.v2's GenerateStream: requests admitted as they come (each on a task of its
        own, so one being tokenized holds up no other), all their outputs on one stream."""
        out: asyncio.Queue = asyncio.Queue()
        self._muxes.add(out)
        mine: dict[str, object] = {}  # rid -> RequestStream, admitted on this call
        admitting: set[asyncio.Task] = set()

        async def admit_one(msg) -> None:
            ctx = tracing.extract({"traceparent": msg.traceparent}) if msg.traceparent else None
            token = otel_context.attach(ctx) if ctx is not None else None
            try:
                if not msg.generate.rid:  # the stream's outputs say whose they are by rid
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "rid is required on GenerateStream")
                with tracing.tracer().start_as_current_span("tokenizer.generate", kind=SpanKind.SERVER,
                                                            attributes={"radixmesh.request_id": msg.generate.rid}):
                    mine[msg.generate.rid] = await self.admit(msg.generate, mux=out)
            except Refused as e:
                out.put_nowait(opb.OutputBatch(errors=[opb.RequestError(
                    rid=msg.generate.rid, error=cpb.Error(code=e.code.value[0], message=e.message))]))
            finally:
                if token is not None:
                    otel_context.detach(token)

        async def read() -> None:
            async for msg in request_iterator:
                if msg.HasField("generate"):
                    task = asyncio.ensure_future(admit_one(msg))
                    admitting.add(task)
                    task.add_done_callback(admitting.discard)
                elif msg.cancel and msg.cancel in mine:
                    self.end(mine.pop(msg.cancel))

        reader = asyncio.ensure_future(read())
        try:
            async for batch in drain_batches(out):
                for done in batch.errors:
                    mine.pop(done.rid, None)
                for seq in batch.outputs:
                    if seq.HasField("finish") and seq.rid in mine and not mine[seq.rid].open:
                        del mine[seq.rid]
                yield batch
        finally:
            self._muxes.discard(out)
            reader.cancel()
            for task in list(admitting):
                task.cancel()
            for stream in mine.values():
                self.end(stream)

    def _submit_request(self, rid: str, ids: list[int], request: pb.GenerateTextRequest) -> spb2.SubmitRequest:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        sreq = spb2.SubmitRequest(
            rid=rid, input_ids=ids, sampling=request.sampling, namespace=request.namespace, adapter=request.adapter,
            text_options=opb.TextOptions(
                skip_special_tokens=skip, include_stop_str_in_output=request.include_stop_str_in_output,
                context_ids=ids[-CONTEXT_IDS:], min_tokens=max(request.sampling.min_new_tokens, 0),
                reply_to=self.subscription.name))
        if request.HasField("n"):
            sreq.n = request.n
        if request.HasField("disaggregation"):  # the router's pairing: passed on as it came
            sreq.disaggregation.CopyFrom(request.disaggregation)
        return sreq

    def _check(self, request: pb.GenerateTextRequest, rid: str) -> None:
        """The checks the gateway makes on HTTP, made here for gRPC clients: raise InvalidRequest."""
        sampling = sampling_from_proto(request.sampling)
        if not request.sampling.HasField("max_new_tokens"):  # filled in later from the room left
            sampling.max_new_tokens = max(sampling.min_new_tokens, 1)
        sampling.validate(self.model_info.model.vocab_size)
        check_request_limits(sampling, request.n if request.HasField("n") else 1, rid)

    def _token_room(self) -> tuple[int, str]:
        """(tokens a request may span, what bounds it): the model's context length, or the KV
        pool when it holds less (a longer request could never be admitted)."""
        info, context = self.model_info, self.model_info.model.max_position_embeddings
        pool = info.num_kv_pages * info.page_size
        if 0 < pool < context:
            return pool, f"the KV cache's {pool} tokens"
        return context, f"the model's context length of {context} tokens"

    async def _prompt_ids(self, request: pb.GenerateTextRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("give one of text, conversation or input_ids")
        if which == "input_ids":
            return list(request.input_ids.ids)
        if which == "text":
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            return await asyncio.to_thread(self.tokenizer.encode, request.text, add)
        text = self._render(request.conversation, True)
        return await asyncio.to_thread(self.tokenizer.encode, text, False)

    def _render(self, conv: pb.Conversation, add_generation_prompt: bool) -> str:
        messages, tools = messages_from_proto(conv), tools_from_proto(conv)
        if not messages:
            raise InvalidRequest("the conversation has no messages")
        if tools and not template_takes_tools(self.tokenizer.chat_template):
            messages, tools = inline_tools(messages, tools, tool_format_from_proto(conv)), None
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=tools)
        except (ValueError, jinja2.TemplateError) as e:  # no template, or the template rejects the input
            raise InvalidRequest(f"cannot apply the chat template: {e}") from e

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        which = request.WhichOneof("input")
        try:
            if which == "texts":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                texts = list(request.texts.texts)
            elif which == "conversations":
                gen = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
                texts = [self._render(c, gen) for c in request.conversations.conversations]
                add = False  # the template wrote the special tokens
            else:
                raise InvalidRequest("give texts or conversations")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        batch = await asyncio.to_thread(self.tokenizer.encode_batch, texts, add) if texts else []
        return pb.TokenizeResponse(items=[pb.TokenIds(ids=ids) for ids in batch])

    async def ApplyChatTemplate(self, request: pb.ApplyChatTemplateRequest,
                                context: grpc.aio.ServicerContext) -> pb.ApplyChatTemplateResponse:
        gen = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        try:
            prompts = [self._render(c, gen) for c in request.conversations]
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ApplyChatTemplateResponse(prompts=prompts)

    async def Detokenize(self, request: pb.DetokenizeIdsRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeIdsResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        vocab = self.model_info.model.vocab_size
        for item in request.items:
            bad = [i for i in item.ids if not 0 <= i < vocab]
            if bad:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        tok = self.tokenizer
        return pb.DetokenizeIdsResponse(
            texts=[tok.decode(list(item.ids), skip_special_tokens=skip) for item in request.items],
            tokens=[pb.TokenStrings(strs=[tok.id_to_token(i) or "" for i in item.ids]) for item in request.items])

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        m, tok = self.model_info.model, self.tokenizer
        resp = pb.InfoResponse(model_name=m.name, vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids,
                               context_length=m.max_position_embeddings,
                               has_chat_template=tok.chat_template is not None,
                               tool_call_format=native_format(tok.chat_template),
                               disaggregation_mode=self.model_info.disaggregation_mode,
                               bootstrap_address=self.model_info.bootstrap_address)
        if tok.bos_token_id is not None:
            resp.bos_token_id = tok.bos_token_id
        pad = tok.special_tokens.get("pad_token")
        if pad is not None and tok.raw.token_to_id(pad) is not None:
            resp.pad_token_id = tok.raw.token_to_id(pad)
        return resp

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        """For routers: the scheduler's queue, KV use and prefix-cache counters, plus our open calls."""
        try:
            s = await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler: {e.code().name} {e.details()}")
        return pb.LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting, in_flight=len(self._active),
            kv_usage=s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0,
            cache_hit_tokens=s.cache_hit_tokens, cache_query_tokens=s.cache_query_tokens,
            cache_hit_rate=s.cache_hit_tokens / s.cache_query_tokens if s.cache_query_tokens else 0.0,
            weights_version=s.weights_version, adapters=s.adapters, resident_adapters=s.resident_adapters)

    async def Ready(self, request: pb.ReadyRequest, context: grpc.aio.ServicerContext) -> pb.ReadyResponse:
        stages = await asyncio.gather(self._scheduler_stages(), self._detokenizer_stage())
        flat = [*stages[0], stages[1]]
        return pb.ReadyResponse(ready=all(s.serving for s in flat), stages=flat)

    async def _scheduler_stages(self) -> list[pb.StageHealth]:
        addr = self.config.scheduler_addr
        try:
            stats = await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        except grpc.aio.AioRpcError as e:
            return [pb.StageHealth(stage="scheduler", address=addr, serving=False,
                                   detail=f"{e.code().name}: {e.details()}")]
        # The scheduler's health says NOT_SERVING while its worker is lost or not making progress.
        serving = await self._scheduler_health() == health_pb2.HealthCheckResponse.SERVING
        worker_ok = stats.worker_connected and serving
        detail = ("the scheduler has no worker stream" if not stats.worker_connected
                  else "" if serving else "the scheduler's health is NOT_SERVING: its worker is not making progress")
        return [pb.StageHealth(stage="scheduler", address=addr, serving=True),
                pb.StageHealth(stage="worker", serving=worker_ok, detail=detail)]

    async def _scheduler_health(self) -> int:
        try:
            resp = await health_pb2_grpc.HealthStub(self._sched_channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2)
            return resp.status
        except grpc.aio.AioRpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN

    async def _detokenizer_stage(self) -> pb.StageHealth:
        addr = self.config.detokenizer_addr
        try:
            await self._detokenizer_serving()
        except (grpc.aio.AioRpcError, ConnectionError) as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            return pb.StageHealth(stage="detokenizer", address=addr, serving=False, detail=detail)
        if not self.subscription.connected.is_set():  # the outputs path from it to us
            return pb.StageHealth(stage="detokenizer", address=addr, serving=False,
                                  detail=f"no outputs subscription: {self.subscription.down_reason}")
        return pb.StageHealth(stage="detokenizer", address=addr, serving=True)


def fill_max_new_tokens(prompt_len: int, room: tuple[int, str], cap: int | None) -> int:
    """max_new_tokens for a request that gave none: what `room` (tokens, its description)
    leaves after the prompt, at most `cap` (None or 0 = no cap). Raises InvalidRequest when
    the prompt leaves no room at all."""
    tokens, what = room
    left = tokens - prompt_len
    if left < 1:
        raise InvalidRequest(f"the prompt ({prompt_len} tokens) leaves no room for output within {what}")
    return min(left, cap) if cap else left


async def _retry(attempt, deadline: float, what: str):
    """await attempt() until it succeeds; past the deadline raise with the last error."""
    while True:
        try:
            return await attempt()
        except (grpc.aio.AioRpcError, ConnectionError) as e:
            if time.monotonic() > deadline:
                detail = f"{e.code().name} {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
                raise RuntimeError(f"{what} is not ready: {detail}") from e
            await asyncio.sleep(0.5)


def v1_events(resp: pb2.GenerateResponse) -> list[cpb.GenerateResponse]:
    """radixmesh.v2 outputs as radixmesh.v1 events: a chunk per output with tokens or text (its
    finish copied onto it), then the Finish on its own."""
    events = []
    for out in resp.outputs:
        u = out.usage
        if out.token_ids or out.text or out.prompt_logprobs or out.embedding:
            chunk = cpb.GenerateChunk(
                index=out.index, token_ids=out.token_ids, text=out.text, logprobs=out.logprobs,
                prompt_logprobs=out.prompt_logprobs, embedding=out.embedding,
                prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                spec_verify_steps=u.spec_verify_steps, spec_draft_tokens=u.spec_draft_tokens,
                spec_accepted_tokens=u.spec_accepted_tokens, weights_version=out.weights_version)
            if out.HasField("finish"):
                chunk.finish.CopyFrom(out.finish)
            events.append(cpb.GenerateResponse(chunk=chunk))
        if out.HasField("finish"):
            events.append(cpb.GenerateResponse(finish=out.finish))
    return events


class TokenizerV2(tokenizer2_grpc.TokenizerServicer):
    """radixmesh.v2.Tokenizer over a TokenizerService."""

    def __init__(self, service: TokenizerService) -> None:
        self.service = service

    async def Generate(self, request: pb.GenerateTextRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb2.GenerateResponse]:
        async for resp in self.service.generate(request, context):
            yield resp

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async for batch in self.service.generate_stream(request_iterator, context):
            yield batch

