"""`radixmesh serve tokenizer`: the replica's entry point (Generate), and text ↔ ids."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc, tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common import tracing
from services.common.admin_forward import ForwardingAdmin
from services.common.config import CommonConfig, parse_config
from services.common.server import run_service

DEFAULT_LISTEN = "127.0.0.1:50051"


@dataclass(frozen=True)
class TokenizerServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    model: str | None = field(default=None, metadata={
        "help": "a .gguf file or HF directory whose tokenizer and chat template to use; default: SmolLM2-135M-Instruct"})
    scheduler_addr: str = field(default="127.0.0.1:50052", metadata={"help": "the scheduler's gRPC HOST:PORT"})
    detokenizer_addr: str = field(default="127.0.0.1:50054", metadata={"help": "the detokenizer's gRPC HOST:PORT"})
    peer_wait_s: float = field(default=600.0, metadata={
        "help": "at start: seconds to wait for the scheduler (and its worker) and the detokenizer"})
    default_max_tokens: int | None = field(default=None, metadata={
        "help": "when a request leaves max_new_tokens unset it gets what the context leaves after the prompt "
                "(as OpenAI does), at most this many; none = no cap"})

    def __post_init__(self) -> None:
        if self.peer_wait_s <= 0:
            raise ValueError(f"--peer-wait-s must be > 0, got {self.peer_wait_s}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve tokenizer", description=__doc__)
    config = parse_config(TokenizerServiceConfig, argv, parser)
    from services.tokenizer.service import TokenizerService, TokenizerV2

    service = TokenizerService(config)

    def add_servicers(server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(service, server)
        tokenizer2_grpc.add_TokenizerServicer_to_server(TokenizerV2(service), server)
        # Model administration passes through to the scheduler (services/common/admin_forward.py).
        admin_pb2_grpc.add_ModelAdminServicer_to_server(
            ForwardingAdmin(lambda: tracing.channel(config.scheduler_addr), f"scheduler {config.scheduler_addr}"),
            server)

    return run_service("tokenizer", config.common, add_servicers, on_start=service.start, on_drain=service.drain,
                       registry=service.registry)
