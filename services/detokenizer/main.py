"""`radixmesh serve detokenizer`: token ids → text deltas, UTF-8 safe, stop strings applied.

It reads its scheduler's outputs (radixmesh.v2.Scheduler.Outputs) and passes them on, with their
text, to the tokenizers subscribed to it (radixmesh.v2.Detokenizer.Texts); health is SERVING while
it reads them. radixmesh.v1.Detokenizer (a stream per request) is still served."""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import detokenizer_pb2_grpc
from protos.radixmesh.v2 import detokenizer_pb2_grpc as detokenizer2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.server import Readiness, run_service

DEFAULT_LISTEN = "127.0.0.1:50054"


@dataclass(frozen=True)
class DetokenizerServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    model: str | None = field(default=None, metadata={
        "help": "a .gguf file or HF directory whose tokenizer to use; default: SmolLM2-135M-Instruct"})
    scheduler_addr: str = field(default="127.0.0.1:50052", metadata={
        "help": "the scheduler whose outputs to detokenize (gRPC HOST:PORT)"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve detokenizer", description=__doc__)
    config = parse_config(DetokenizerServiceConfig, argv, parser)
    from services.detokenizer.service import DetokenizerService, TextsServicer
    from services.tokenizer.text_tokenizer import load_tokenizer

    service = DetokenizerService(None)
    readiness = Readiness()
    texts = TextsServicer(service, readiness)

    async def on_start() -> None:
        from services.common.metrics import model_name_of

        service.tokenizer, service.model_name = await asyncio.gather(
            asyncio.to_thread(load_tokenizer, config.model), asyncio.to_thread(model_name_of, config.model))
        texts.start(config.scheduler_addr)

    def add_servicers(server: grpc.aio.Server) -> None:
        detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(service, server)
        detokenizer2_grpc.add_DetokenizerServicer_to_server(texts, server)

    return run_service("detokenizer", config.common, add_servicers, on_start=on_start, on_drain=texts.drain,
                       registry=service.registry, readiness=readiness)
