"""What the gateway needs from the mesh, as an interface with transport-free types.

The gateway talks to exactly one thing: the replica's entry point (the
tokenizer service, or later a router with the same Generate/Info surface).
`Backend` is the seam: `GrpcBackend` (grpc_backend.py) speaks gRPC, and
`FakeBackend` (tests/doubles/fake_backend.py) answers in-process for tests.

Contract of `Backend.generate(call)`: an async iterator of lists of `RequestOutput`
(services/common/outputs.py), one list per message from the backend (a step's outputs,
which the gateway writes to an SSE client at once): new tokens of a sequence (`finished`
False), and exactly one finishing output, with no tokens, per sequence index in [0, call.n).
Failures raise `BackendError` (before the first event or mid-stream).
Closing the iterator early (aclose, or cancelling the task awaiting it)
aborts the request in the mesh; callers use `contextlib.aclosing`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import admin_pb2, admin_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2 as tokenizer2_pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common import tracing
from services.common.admin_forward import TIMEOUT_S as ADMIN_TIMEOUT_S
from services.common.convert import sampling_to_proto
from services.common.outputs import RequestOutput
from services.common.outputs_convert import output_from_proto
from services.common.sampling_params import SamplingParams
from services.gateway.multiplexer import Multiplexer, StreamBroken

# A shared GenerateStream call that ends with these before this request got anything: the request
# runs on a Generate call of its own. UNIMPLEMENTED: the backend has no GenerateStream (a router,
# an older tokenizer), so every later request does too. INTERNAL: grpc's client reports a
# request written while the server was ending the call as "Internal error from Core" instead of
# the server's status (seen when the server answers UNIMPLEMENTED at once); the request's own
# call then gives the real answer.
FALL_BACK_CODES = ("UNIMPLEMENTED", "INTERNAL")


class BackendError(Exception):
    """A failed request or call. `code` is a grpc.StatusCode name, e.g.
    "INVALID_ARGUMENT" (bad input), "RESOURCE_EXHAUSTED" (queue full),
    "UNAVAILABLE" (backend down); errors.py maps it to HTTP."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...] = ()
    has_chat_template: bool = True
    tool_call_format: str = "hermes"  # tool_choice auto's format: the template's, or --tool-call-parser's
    # LoRA adapters loaded behind the backend (requests name one as their model), and its weights'
    # version: from ModelAdmin.GetModelState, refreshed with the readiness checks.
    adapters: tuple[str, ...] = ()
    adapter_paths: tuple[str, ...] = ()
    weights_version: str = ""


@dataclass
class GenerateCall:
    """One generation request: exactly one of text, messages, input_ids."""
    rid: str
    sampling: SamplingParams
    n: int = 1
    text: str | None = None
    messages: list[dict] | None = None  # [{"role", "content", optional "name", "tool_calls", "tool_call_id"}]
    tools: list[dict] | None = None  # OpenAI's function tools, for the chat template
    tool_call_format: str = ""  # with tools: the format to describe when the template takes no tools
    input_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The client gave no max_tokens: the backend gives what the context leaves after the
    # prompt (OpenAI's default), at most fill_cap; sampling.max_new_tokens is then only
    # the largest value that can come out of it and is not sent.
    fill_context: bool = False
    fill_cap: int | None = None
    adapter: str = ""  # the LoRA adapter to run under ("" = the base model)


Event = RequestOutput  # per sequence `index`: token outputs, then one finishing output without tokens


class Backend(Protocol):
    async def info(self) -> ModelInfo:
        """The served model; raises BackendError when the backend cannot answer."""

    async def not_ready(self) -> str | None:
        """None when the backend can serve now, else why not; never raises."""

    def generate(self, call: GenerateCall) -> AsyncIterator[list[Event]]:
        """See the module docstring."""

    async def close(self) -> None:
        """Release connections; in-flight generate iterators are cancelled."""

    async def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's token ids, in order."""

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None,
                                  add_generation_prompt: bool) -> str:
        """The conversation rendered by the model's chat template (INVALID_ARGUMENT without one)."""

    async def detokenize(self, items: list[list[int]], skip_special_tokens: bool
                         ) -> tuple[list[str], list[list[str]]]:
        """(each item's text, each item's ids as the vocabulary spells them); INVALID_ARGUMENT for
        an id outside the vocabulary."""


# --- the gRPC client -----------------------------------------------------------------

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _rpc_error(e: grpc.aio.AioRpcError) -> BackendError:
    return BackendError(e.code().name, e.details() or "")


def generate_request(call: GenerateCall) -> tokenizer_pb2.GenerateTextRequest:
    """GenerateCall → the tokenizer's request. Raises ValueError for integers
    protobuf cannot hold (the gateway bounds them before)."""
    req = tokenizer_pb2.GenerateTextRequest(
        rid=call.rid, sampling=sampling_to_proto(call.sampling, unset_max_new_tokens=call.fill_context), n=call.n,
        skip_special_tokens=call.skip_special_tokens, include_stop_str_in_output=call.include_stop_str_in_output,
        adapter=call.adapter)
    if call.fill_context and call.fill_cap is not None:
        req.default_max_new_tokens = call.fill_cap
    if call.input_ids is not None:
        req.input_ids.ids.extend(call.input_ids)
    elif call.messages is not None:
        req.conversation.messages.extend(_chat_message(m) for m in call.messages)
        if call.tools:
            req.conversation.tools_json = json.dumps(call.tools)
            req.conversation.tool_call_format = call.tool_call_format
    else:
        req.text = call.text or ""
    return req


def _chat_message(m: dict) -> tokenizer_pb2.ChatMessage:
    calls = m.get("tool_calls")
    return tokenizer_pb2.ChatMessage(**{k: v for k, v in m.items() if k != "tool_calls"},
                                     tool_calls_json=json.dumps(calls) if calls else "")


def events(msg: tokenizer2_pb2.GenerateResponse, rid: str | None = None) -> list[Event]:
    """One radixmesh.v2 message → the Backend contract's events (under `rid`, if given): a
    sequence's output with tokens or text, and its finish as an output of its own."""
    if msg.HasField("error"):
        raise BackendError(_CODE_NAMES.get(msg.error.code, "INTERNAL"), msg.error.message)
    out = []
    for seq in msg.outputs:
        event = output_from_proto(seq)
        if rid is not None:
            event.rid = rid
        if event.token_ids or event.text or event.prompt_logprobs or event.embedding:
            out.append(replace(event, finished=False, finish_reason=None, matched_stop=None))
        if event.finished:
            out.append(replace(event, token_ids=[], logprobs=[], text="", prompt_logprobs=[], embedding=[]))
    return out


class GrpcBackend:
    """Backend over one gRPC channel to the tokenizer service (or a router)."""

    def __init__(self, address: str, probe_timeout_s: float = 5.0) -> None:
        self.address = address
        self.probe_timeout_s = probe_timeout_s
        self._channel = tracing.channel(address)  # carries the HTTP request's trace on
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._stub_v2 = tokenizer2_grpc.TokenizerStub(self._channel)
        self._mux: Multiplexer | None = None  # the shared GenerateStream call, opened on first use
        self._multiplexed: bool | None = None  # False once the backend answered UNIMPLEMENTED
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._admin = admin_pb2_grpc.ModelAdminStub(self._channel)

    async def info(self) -> ModelInfo:
        try:
            r = await self._stub.Info(tokenizer_pb2.InfoRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None
        try:
            state = await self._admin.GetModelState(admin_pb2.GetModelStateRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError:  # a backend without model administration: no adapters to list
            state = admin_pb2.ModelState()
        return ModelInfo(r.model_name, r.vocab_size, r.context_length, tuple(r.eos_token_ids),
                         r.has_chat_template, r.tool_call_format, tuple(a.name for a in state.adapters),
                         tuple(a.path for a in state.adapters), state.weights_version)

    async def _unary(self, method: str, request):
        try:
            return await getattr(self._stub, method)(request, timeout=ADMIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None

    async def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        r = await self._unary("Tokenize", tokenizer_pb2.TokenizeRequest(
            texts=tokenizer_pb2.TextBatch(texts=texts), add_special_tokens=add_special_tokens))
        return [list(item.ids) for item in r.items]

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None,
                                  add_generation_prompt: bool) -> str:
        conv = tokenizer_pb2.Conversation(messages=[_chat_message(m) for m in messages],
                                          tools_json=json.dumps(tools) if tools else "")
        r = await self._unary("ApplyChatTemplate", tokenizer_pb2.ApplyChatTemplateRequest(
            conversations=[conv], add_generation_prompt=add_generation_prompt))
        return r.prompts[0]

    async def detokenize(self, items: list[list[int]], skip_special_tokens: bool
                         ) -> tuple[list[str], list[list[str]]]:
        r = await self._unary("Detokenize", tokenizer_pb2.DetokenizeIdsRequest(
            items=[tokenizer_pb2.TokenIds(ids=ids) for ids in items], skip_special_tokens=skip_special_tokens))
        return list(r.texts), [list(t.strs) for t in r.tokens]

    async def admin(self, method: str, request) -> admin_pb2.ModelState:
        """One radixmesh.v1.ModelAdmin call (a router fans it out to every replica)."""
        try:
            return await getattr(self._admin, method)(request, timeout=ADMIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None

    async def not_ready(self) -> str | None:
        """grpc health of the tokenizer must be SERVING, and its Ready (the
        whole path behind it: scheduler, worker, detokenizer) must say ready."""
        serving = True
        try:
            h = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.probe_timeout_s)
            serving = h.status == health_pb2.HealthCheckResponse.SERVING
            r = await self._stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            if not serving:  # Ready is refused while loading or draining
                return f"the tokenizer at {self.address} is not serving (draining or loading)"
            return f"the tokenizer at {self.address} does not answer: {e.code().name} {e.details() or ''}".rstrip()
        if not serving and r.ready:
            return f"the tokenizer at {self.address} is not serving"
        if not r.ready:
            down = [f"{s.stage} at {s.address}: {s.detail or 'not serving'}" for s in r.stages if not s.serving]
            return "not every stage is serving: " + ("; ".join(down) or "no detail")
        return None

    async def health_changes(self) -> AsyncIterator[int]:
        """The backend's grpc health status (Watch): the current one, then each change. Ends
        or raises grpc.aio.AioRpcError when the stream breaks (the backend went away)."""
        call = self._health.Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            async for resp in call:
                yield resp.status
        finally:
            call.cancel()

    async def generate(self, call: GenerateCall) -> AsyncIterator[list[Event]]:
        """On the shared GenerateStream call when the backend has one; else (a router, an older
        tokenizer: UNIMPLEMENTED) on a Generate call of its own."""
        try:
            request = generate_request(call)
        except ValueError as e:
            raise BackendError("INVALID_ARGUMENT", str(e)) from None
        if self._multiplexed is not False:
            started = False
            try:
                async for batch in self._multiplexer().generate(request, lambda msg: events(msg, call.rid)):
                    started = True
                    yield batch
                return
            except StreamBroken as e:
                if started or e.code not in FALL_BACK_CODES:
                    raise BackendError(e.code, e.message) from None
                if e.code == "UNIMPLEMENTED":
                    self._multiplexed = False
        async for batch in self._generate_alone(request, call.rid):
            yield batch

    def _multiplexer(self) -> Multiplexer:
        if self._mux is None or self._mux.broken is not None:
            self._mux = Multiplexer(self._stub_v2.GenerateStream)
        return self._mux

    async def _generate_alone(self, request: tokenizer_pb2.GenerateTextRequest, rid: str) -> AsyncIterator[list[Event]]:
        rpc = self._stub_v2.Generate(request)
        try:
            async for msg in rpc:
                batch = events(msg, rid)
                if batch:
                    yield batch
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None
        finally:
            rpc.cancel()  # no-op once the call ended; otherwise aborts the request in the mesh

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.close()
        await self._channel.close()
