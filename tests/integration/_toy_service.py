"""A toy service on the real bootstrap, for tests/integration/test_service_bootstrap.py.

    python tests/integration/_toy_service.py --listen 127.0.0.1:0 --load-seconds 1

Serves a stub radixmesh.v1.Scheduler (Generate streams one chunk per
`chunk_seconds`, max_new_tokens chunks, then a Finish) and a generic-handler
service `radixmesh.test.Echo/Echo` (raw bytes back), so both ways of
registering a servicer are exercised.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import AsyncIterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import grpc  # noqa: E402

from protos.radixmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from services.common.config import CommonConfig, parse_config  # noqa: E402
from services.common.server import run_service  # noqa: E402

log = logging.getLogger("toy")


@dataclass(frozen=True)
class ToyConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(drain_timeout_s=10.0))
    load_seconds: float = field(default=0.0, metadata={"help": "on_start sleeps this long"})
    chunk_seconds: float = field(default=0.1, metadata={"help": "delay between streamed chunks"})


class StubScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, chunk_seconds: float) -> None:
        self.chunk_seconds = chunk_seconds

    async def Generate(self, request: scheduler_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        for i in range(request.sampling.max_new_tokens):
            await asyncio.sleep(self.chunk_seconds)
            yield common_pb2.GenerateResponse(chunk=common_pb2.GenerateChunk(token_ids=[i]))
        yield common_pb2.GenerateResponse(finish=common_pb2.Finish(
            finish_reason=common_pb2.FINISH_REASON_LENGTH))

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(num_running=1)


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def main() -> int:
    config = parse_config(ToyConfig)

    def add_servicers(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(StubScheduler(config.chunk_seconds), server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "radixmesh.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}),))

    async def on_start() -> None:
        await asyncio.sleep(config.load_seconds)

    async def on_drain(deadline: float) -> None:
        log.info("on_drain called")

    return run_service("toy", config.common, add_servicers, on_start, on_drain)


if __name__ == "__main__":
    sys.exit(main())
