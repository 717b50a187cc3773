"""`radixmesh serve router`: many replicas behind one front door.

    radixmesh serve router --replica-addrs 127.0.0.1:50051 127.0.0.1:50061 [--policy cache_aware]
    radixmesh serve router --replica-dns radixmesh-engine.default.svc.cluster.local:50051   # Kubernetes

Serves radixmesh.v1.Tokenizer (point the gateway's --tokenizer-addr here) and the
radixmesh.v1.Router admin service; docs/router.md explains policies, flags and faults.
"""
from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc, router_pb2_grpc, tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common.config import parse_config
from services.common.server import run_service
from services.router import metrics
from services.router.config import RouterConfig

if TYPE_CHECKING:
    from services.router.discovery import DnsDiscovery
    from services.router.fleet import Fleet

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    config = parse_config(RouterConfig, argv, parser)
    from services.common.server import Readiness
    from services.router.fleet import Fleet
    from services.router.admin_fanout import FanOutAdmin
    from services.router.service import RouterAdmin, RouterFront, RouterFrontV2

    readiness = Readiness()  # NOT_SERVING while no replica is routable (services/router/fleet.py)
    fleet = Fleet(config, readiness)  # channels are opened in start(), on the server's event loop
    front, admin = RouterFront(config, fleet), RouterAdmin(config, fleet)
    discovery = _discovery(config, fleet)

    def add_servicers(server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(front, server)
        tokenizer2_grpc.add_TokenizerServicer_to_server(RouterFrontV2(front), server)
        router_pb2_grpc.add_RouterServicer_to_server(admin, server)
        admin_pb2_grpc.add_ModelAdminServicer_to_server(FanOutAdmin(fleet), server)  # to every replica

    async def start() -> None:
        for address in config.replica_addrs:
            fleet.add(address)
        fleet.start()
        if config.replica_addrs:
            admitted = await fleet.wait_healthy(list(config.replica_addrs), config.peer_wait_s)
            if not admitted:
                raise RuntimeError(f"no replica became SERVING within {config.peer_wait_s}s")
            log.info("replicas ready", extra={"admitted": admitted, "policy": config.policy,
                                              "missing": sorted(set(config.replica_addrs) - set(admitted))})
        if discovery is not None:
            # No waiting here: engine pods may load their model for minutes; the router's health
            # follows the routable set meanwhile.
            await discovery.refresh()
            discovery.start()
        fleet.track_readiness()

    async def drain(deadline: float) -> None:
        # The server's gate waits for in-flight streams; replicas keep serving them.
        if discovery is not None:
            await discovery.stop()

    return run_service("router", config.common, add_servicers, on_start=start, on_drain=drain,
                       registry=metrics.REGISTRY, readiness=readiness)


def _discovery(config: RouterConfig, fleet: Fleet) -> DnsDiscovery | None:
    if config.replica_dns is None:
        return None
    from services.router.discovery import DnsDiscovery

    return DnsDiscovery(config.replica_dns, fleet, interval_s=config.replica_dns_interval_s,
                        drain_wait_s=config.drain_wait_s)
