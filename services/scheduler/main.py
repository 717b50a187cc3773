"""`radixmesh serve scheduler`: request queue, radix cache and batching, driving one worker."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import scheduler_pb2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.server import run_service
from services.scheduler.config import HiCacheConfig, SchedulerConfig

DEFAULT_LISTEN = "127.0.0.1:50052"


@dataclass(frozen=True)
class SchedulerServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)  # policies; tiers and store come from the worker
    worker_addr: str = field(default="127.0.0.1:50053", metadata={"help": "the worker's gRPC HOST:PORT"})
    worker_wait_s: float = field(default=600.0, metadata={
        "help": "at start: seconds to wait for the worker to load and answer before giving up"})
    check_invariants: bool = field(default=False, metadata={
        "help": "check KV accounting after every step (tests, debugging; costs O(pages) per step)"})

    def __post_init__(self) -> None:
        if self.worker_wait_s <= 0:
            raise ValueError(f"--worker-wait-s must be > 0, got {self.worker_wait_s}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve scheduler", description=__doc__)
    config = parse_config(SchedulerServiceConfig, argv, parser)
    from services.scheduler.service import SchedulerService

    service = SchedulerService(config)

    def add_servicers(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)

    return run_service("scheduler", config.common, add_servicers, on_start=service.start, on_drain=service.drain,
                       registry=service.telemetry.registry)
