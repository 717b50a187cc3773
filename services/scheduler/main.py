"""`radixmesh serve scheduler`: request queue, radix cache and batching, driving one worker."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc, scheduler_pb2_grpc
from protos.radixmesh.v2 import scheduler_pb2_grpc as scheduler2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.hicache_config import HiCacheConfig
from services.common.server import run_service
from services.scheduler.config import SchedulerConfig
from services.scheduler.disaggregation import DisaggregationConfig

DEFAULT_LISTEN = "127.0.0.1:50052"


@dataclass(frozen=True)
class SchedulerServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)  # policies; tiers and store come from the worker
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    worker_addr: str = field(default="127.0.0.1:50053", metadata={"help": "the worker's gRPC HOST:PORT"})
    dp_rank: int = field(default=0, metadata={
        "help": "a worker with --enable-dp-attention: the data-parallel rank this scheduler plans for (one "
                "scheduler per rank; radixmesh up starts them)"})
    worker_wait_s: float = field(default=600.0, metadata={
        "help": "at start: seconds to wait for the worker to load and answer before giving up"})
    check_invariants: bool = field(default=False, metadata={
        "help": "check KV accounting after every step (tests, debugging; costs O(pages) per step)"})
    step_stall_floor_s: float = field(default=15.0, metadata={
        "help": "watchdog: a step still unanswered this many seconds (plus --step-stall-per-token-s per token "
                "it runs) after it started marks the worker stalled: health NOT_SERVING and new requests "
                "refused with UNAVAILABLE until the step completes"})
    step_stall_per_token_s: float = field(default=0.01, metadata={
        "help": "watchdog: the allowance per token of a step (prefill chunks and decodes) on top of the floor"})
    bootstrap_address: str = field(default="", metadata={
        "help": "disaggregation, prefill side: the HOST:PORT decode schedulers reach this scheduler's "
                "PrefillBootstrap at (served on its own port); default: the --listen address"})
    disaggregation_heartbeat_s: float = field(default=1.0, metadata={
        "help": "disaggregation: the prefill side's heartbeat on each Attach call; three missed ones mean "
                "the other side is gone"})
    request_timeout_s: float | None = field(default=900.0, metadata={
        "help": "server-side deadline of a Generate call from its arrival: past it the request is aborted (its KV "
                "freed) and its stream ends with a DEADLINE_EXCEEDED error; generous so that a full-context "
                "generation on a CPU fits; none = no deadline"})

    def __post_init__(self) -> None:
        if self.worker_wait_s <= 0:
            raise ValueError(f"--worker-wait-s must be > 0, got {self.worker_wait_s}")
        if self.step_stall_floor_s <= 0 or self.step_stall_per_token_s < 0:
            raise ValueError("--step-stall-floor-s must be > 0 and --step-stall-per-token-s >= 0, got "
                             f"{self.step_stall_floor_s} and {self.step_stall_per_token_s}")
        if not self.disaggregation_heartbeat_s > 0:
            raise ValueError(f"--disaggregation-heartbeat-s must be > 0, got {self.disaggregation_heartbeat_s}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout-s must be > 0 (or none), got {self.request_timeout_s}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve scheduler", description=__doc__)
    config = parse_config(SchedulerServiceConfig, argv, parser)
    from services.scheduler.admin_service import SchedulerAdminService
    from protos.radixmesh.v1 import disaggregation_pb2_grpc
    from services.scheduler.pd_link import PrefillBootstrapServicer
    from services.scheduler.service import OutputsServicer, SchedulerService

    service = SchedulerService(config)

    def add_servicers(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
        scheduler2_grpc.add_SchedulerServicer_to_server(OutputsServicer(service), server)
        admin_pb2_grpc.add_ModelAdminServicer_to_server(SchedulerAdminService(service), server)
        disaggregation_pb2_grpc.add_PrefillBootstrapServicer_to_server(PrefillBootstrapServicer(lambda: service.pd),
                                                                       server)

    return run_service("scheduler", config.common, add_servicers, on_start=service.start, on_drain=service.drain,
                       registry=service.telemetry.registry, readiness=service.readiness, on_bound=service.bound)
