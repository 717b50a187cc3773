"""radixmesh over gRPC: the tokenizer's Generate, the entry point of a replica or of a router (which
serves the same API). No gateway in between; the same programs, texts and meta_info as
backend_http.py (the contract: radixmesh/lang/backend.py).

The request is radixmesh.v1's GenerateTextRequest; the answer is read from radixmesh.v2.Tokenizer's
Generate (protos/radixmesh/v2/tokenizer.proto, the one the gateway reads), whose every output
carries the usage: v1's stream has no chunk, hence no prompt or cached token counts, for a
sequence that ends without a token (a prefill, max_new_tokens 0). Info, ApplyChatTemplate and
ModelAdmin are v1's.

    radixmesh up --no-gateway      # prints: ... tokenizer gRPC at 127.0.0.1:PORT
    GrpcBackend("127.0.0.1:PORT")

select scores the choices by the prompt logprobs Generate returns on the first chunk
(SamplingParams.prompt_logprobs, logprob_start_len); flush_cache is ModelAdmin.FlushCache, which the
tokenizer forwards to its scheduler (and a router to every replica)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc, common_pb2, scheduler_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from protos.radixmesh.v2 import outputs_pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from radixmesh.lang import template
from radixmesh.lang.backend import Backend, BackendError, Row
from radixmesh.lang.ir import Gen

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}
_CONSTRAINTS = ("regex", "json_schema")  # Gen's, as common.proto's Constraint kinds


def sampling_proto(sp: dict) -> common_pb2.SamplingParams:
    """Gen.sampling_params() (SGLang's /generate dict) as common.proto's SamplingParams."""
    out = common_pb2.SamplingParams(max_new_tokens=sp["max_new_tokens"], temperature=sp["temperature"],
                                    stop=sp.get("stop", []))
    if "top_p" in sp:
        out.top_p = sp["top_p"]
    if sp.get("ignore_eos"):
        out.ignore_eos = True
    for kind in _CONSTRAINTS:
        if kind in sp:
            out.constraint.CopyFrom(common_pb2.Constraint(kind=kind, spec=sp[kind]))
    return out


def request(prompt: str | list[int], sampling: common_pb2.SamplingParams) -> tokenizer_pb2.GenerateTextRequest:
    """A text (tokenized as /generate's text is) or token ids."""
    if isinstance(prompt, str):
        return tokenizer_pb2.GenerateTextRequest(text=prompt, sampling=sampling)
    return tokenizer_pb2.GenerateTextRequest(input_ids=tokenizer_pb2.TokenIds(ids=prompt), sampling=sampling)


def rows(lps) -> list[Row]:
    """TokenLogprobs as SGLang's input_token_logprobs rows."""
    return [[lp.logprob if lp.HasField("logprob") else None, lp.token_id,
             lp.token if lp.HasField("token") else None] for lp in lps]


class GrpcBackend(Backend):
    """`address` of a tokenizer (or router) gRPC endpoint; or an open `channel` (TLS, interceptors)."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout_s: float = 300.0,
                 role_format: template.RoleFormat | None = None, channel: grpc.Channel | None = None) -> None:
        super().__init__(role_format)
        self.channel = channel or grpc.insecure_channel(address)
        self.timeout_s = timeout_s
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self._generate = tokenizer2_grpc.TokenizerStub(self.channel).Generate
        self.info = self._unary(self._stub.Info, tokenizer_pb2.InfoRequest())

    def close(self) -> None:
        self.channel.close()

    def _unary(self, call, req):
        try:
            return call(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise BackendError(f"{e.code().name}: {e.details()}") from None

    def render(self, messages: list[dict]) -> str:
        convo = tokenizer_pb2.Conversation(messages=[tokenizer_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                     for m in messages])
        return self._unary(self._stub.ApplyChatTemplate, tokenizer_pb2.ApplyChatTemplateRequest(
            conversations=[convo], add_generation_prompt=False)).prompts[0]

    def _outputs(self, req: tokenizer_pb2.GenerateTextRequest) -> Iterator[outputs_pb2.SequenceOutput]:
        try:
            for msg in self._generate(req, timeout=self.timeout_s):
                if msg.HasField("error"):
                    raise BackendError(f"Generate: error {msg.error.code}: {msg.error.message}")
                yield from msg.outputs
        except grpc.RpcError as e:
            raise BackendError(f"Generate: {e.code().name}: {e.details()}") from None

    def generate_stream(self, text: str, g: Gen) -> Iterator[tuple[str, dict]]:
        for out in self._outputs(request(text, sampling_proto(g.sampling_params()))):
            meta = {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens,
                    "cached_tokens": out.usage.cached_tokens, "finish_reason": None}
            if out.HasField("finish"):  # n = 1: the one sequence's last output
                f = out.finish
                which = f.WhichOneof("matched_stop")
                meta["finish_reason"] = {"type": _FINISH.get(f.finish_reason),
                                         "matched": getattr(f, which) if which else None}
            if out.text or out.HasField("finish"):
                yield out.text, meta

    def prefill(self, text: str) -> dict:
        return self.generate(text, Gen(max_tokens=0))[1]

    def prompt_logprobs(self, items: list[str] | list[list[int]], start: int) -> list[list[Row]]:
        sampling = common_pb2.SamplingParams(max_new_tokens=0, prompt_logprobs=0, logprob_start_len=start)

        def one(item) -> list[Row]:
            found = [rows(out.prompt_logprobs) for out in self._outputs(request(item, sampling)) if out.prompt_logprobs]
            if not found:
                raise BackendError("Generate answered no prompt logprobs (a tokenizer older than prompt_logprobs?)")
            return found[0]

        with ThreadPoolExecutor(min(len(items), 8)) as pool:  # the choices at once, as /generate's batch
            return list(pool.map(one, items))

    def flush_cache(self) -> None:
        stub = admin_pb2_grpc.ModelAdminStub(self.channel)
        self._unary(stub.FlushCache, scheduler_pb2.FlushCacheRequest())
