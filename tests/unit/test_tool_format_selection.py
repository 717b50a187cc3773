"""Which tool-call format a request gets: the gateway's --tool-call-parser, or with `auto` the one
the tokenizer detects in the chat template (its Info reply); the chosen format travels with the
conversation so a template without tools gets it described in the system message."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import worker_pb2
from services.common.config import config_from_args, flags_from_dataclass
from services.gateway.app import build_app
from services.gateway.backend import ModelInfo, generate_request
from services.gateway.config import GatewayConfig
from services.launcher.up import route_flags
from services.tokenizer.main import TokenizerServiceConfig
from services.tokenizer.service import TokenizerService
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.doubles.fake_backend import FakeBackend
from tests.unit.test_tool_formats import CHATML, TOOLS

LLAMA_TEMPLATE = '{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}' + CHATML


def gateway_config(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    flags_from_dataclass(GatewayConfig, parser)
    return config_from_args(GatewayConfig, parser.parse_args(list(argv)))


def test_the_flag_takes_auto_or_a_known_format(capsys):
    assert gateway_config().tool_call_parser == "auto"
    assert gateway_config("--tool-call-parser", "mistral").tool_call_parser == "mistral"
    with pytest.raises(SystemExit) as exit_:
        gateway_config("--tool-call-parser", "pythonic")
    assert exit_.value.code == 2 and "--tool-call-parser: invalid choice: 'pythonic'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one of auto, hermes, llama3_json, mistral"):
        GatewayConfig(tool_call_parser="pythonic")


@pytest.mark.parametrize("flag,reported,served", [
    ("auto", "llama3_json", "llama3_json"), ("auto", "", "hermes"), ("auto", "a_newer_format", "hermes"),
    ("mistral", "llama3_json", "mistral"), ("hermes", "mistral", "hermes")])
def test_the_flag_overrides_what_the_tokenizer_detected(flag, reported, served):
    assert GatewayConfig(tool_call_parser=flag).tool_format(reported) == served


def test_radixmesh_up_forwards_the_flag_to_the_gateway_only():
    routed = route_flags(["--tool-call-parser", "llama3_json"], ["worker", "scheduler", "tokenizer", "gateway"])
    assert routed == {"worker": [], "scheduler": [], "tokenizer": [], "gateway": ["--tool-call-parser", "llama3_json"]}


class LlamaBackend(FakeBackend):
    async def info(self) -> ModelInfo:
        return replace(await super().info(), tool_call_format="llama3_json")


@pytest.mark.parametrize("flag,expected,trigger", [("auto", "llama3_json", '{"name":'),
                                                    ("mistral", "mistral", "[TOOL_CALLS]")])
async def test_a_chat_with_tools_is_constrained_and_sent_in_the_chosen_format(flag, expected, trigger):
    backend = LlamaBackend()
    client = TestClient(TestServer(build_app(GatewayConfig(tool_call_parser=flag), backend, monitor_backend=False)))
    await client.start_server()
    try:
        r = await client.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4})
        assert r.status == 200, await r.text()
    finally:
        await client.close()
    [call] = backend.calls
    assert call.tool_call_format == expected
    assert trigger in json.loads(call.sampling.constraint.spec)["format"]["triggers"]
    assert generate_request(call).conversation.tool_call_format == expected


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


def tokenizer_service(template: str) -> TokenizerService:
    service = TokenizerService(TokenizerServiceConfig())
    service.tokenizer = TextTokenizer(Tokenizer(WordLevel({"hi": 0}, unk_token="hi")), chat_template=template)
    service.model_info = worker_pb2.WorkerInfo(model=worker_pb2.ModelConfig(name="toy", vocab_size=1))
    return service


async def render(service: TokenizerService, fmt: str) -> str:
    conv = pb.Conversation(messages=[pb.ChatMessage(role="user", content="hi")], tools_json=json.dumps(TOOLS),
                           tool_call_format=fmt)
    reply = await service.ApplyChatTemplate(pb.ApplyChatTemplateRequest(conversations=[conv]), Context())
    return reply.prompts[0]


@pytest.mark.parametrize("template,native", [(CHATML, "hermes"), (LLAMA_TEMPLATE, "llama3_json")])
async def test_the_tokenizer_reports_the_templates_format(template, native):
    info = await tokenizer_service(template).Info(pb.InfoRequest(), Context())
    assert info.tool_call_format == native


async def test_a_template_without_tools_gets_the_chosen_format_in_its_system_message():
    service = tokenizer_service(CHATML)
    assert "<tool_call>" in await render(service, "") and "<tool_call>" in await render(service, "hermes")
    assert "[TOOL_CALLS][" in await render(service, "mistral")
    assert '"parameters": <arguments' in await render(service, "llama3_json")
    with pytest.raises(Aborted, match="unknown tool-call format 'pythonic'"):
        await render(service, "pythonic")
    # a template that takes tools renders them itself, whatever the format
    assert (await render(tokenizer_service(LLAMA_TEMPLATE), "mistral")).startswith("Environment: ipython")

