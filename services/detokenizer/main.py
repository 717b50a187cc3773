"""`radixmesh serve detokenizer`: token ids → text deltas, UTF-8 safe, stop strings applied."""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import detokenizer_pb2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.server import run_service

DEFAULT_LISTEN = "127.0.0.1:50054"


@dataclass(frozen=True)
class DetokenizerServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    model: str | None = field(default=None, metadata={
        "help": "a .gguf file or HF directory whose tokenizer to use; default: SmolLM2-135M-Instruct"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve detokenizer", description=__doc__)
    config = parse_config(DetokenizerServiceConfig, argv, parser)
    from services.detokenizer.service import DetokenizerService
    from services.tokenizer.text_tokenizer import load_tokenizer

    service = DetokenizerService(None)

    async def on_start() -> None:
        from services.common.metrics import model_name_of

        service.tokenizer, service.model_name = await asyncio.gather(
            asyncio.to_thread(load_tokenizer, config.model), asyncio.to_thread(model_name_of, config.model))

    def add_servicers(server: grpc.aio.Server) -> None:
        detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(service, server)

    return run_service("detokenizer", config.common, add_servicers, on_start=on_start, registry=service.registry)
