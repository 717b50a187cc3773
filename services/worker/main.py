"""`radixmesh serve worker`: the model, KV pool and sampler behind a Step stream."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc, worker_pb2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.hicache_config import HiCacheConfig
from services.common.server import run_service
from services.worker.config import WorkerConfig

DEFAULT_LISTEN = "127.0.0.1:50053"


@dataclass(frozen=True)
class WorkerServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)  # host tier + kvstore (docs/kvstore.md)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve worker", description=__doc__)
    config = parse_config(WorkerServiceConfig, argv, parser)
    if config.worker.node_rank > 0:  # another node of a worker group: no gRPC, node 0's worker serves
        from services.common.logging import setup_logging
        from services.worker.group.node import run_node
        setup_logging(f"worker-node{config.worker.node_rank}", config.common.log_level)
        return run_node(config.worker)
    from services.worker.admin_service import WorkerAdminService
    from services.worker.service import WorkerService

    service = WorkerService(config.worker, config.hicache)

    admin = WorkerAdminService(service)

    def add_servicers(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
        admin_pb2_grpc.add_ModelAdminServicer_to_server(admin, server)  # adapters, weight updates

    try:
        return run_service("worker", config.common, add_servicers, on_start=service.start,
                           registry=service.registry)
    finally:
        service.close()
        admin.close()
