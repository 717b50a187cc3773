"""`radixmesh serve router`: many replicas behind one front door.

    radixmesh serve router --replica-addrs 127.0.0.1:50051 127.0.0.1:50061 [--policy cache_aware]
    radixmesh serve router --replica-dns radixmesh-engine.default.svc.cluster.local:50051   # Kubernetes
    radixmesh serve router --prefill 127.0.0.1:50051 --decode 127.0.0.1:50061   # a disaggregated pair of pools

Serves radixmesh.v1.Tokenizer (point the gateway's --tokenizer-addr here) and the
radixmesh.v1.Router admin service; docs/router.md explains policies, flags and faults.
"""
from __future__ import annotations

import argparse
import asyncio
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
    from services.router.pools import Pools

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    config = parse_config(RouterConfig, argv, parser)
    from services.common.server import Readiness
    from services.router.admin_fanout import FanOutAdmin
    from services.router.pools import Pools
    from services.router.service import RouterAdmin, RouterFront, RouterFrontV2

    readiness = Readiness()  # NOT_SERVING while no replica (pair) is routable (services/router/pools.py)
    pools = Pools.build(config, readiness)  # channels are opened in start(), on the server's event loop
    front, admin = RouterFront(config, pools), RouterAdmin(config, pools)
    discoveries = _discoveries(config, pools)

    def add_servicers(server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(front, server)
        tokenizer2_grpc.add_TokenizerServicer_to_server(RouterFrontV2(front), server)
        router_pb2_grpc.add_RouterServicer_to_server(admin, server)
        admin_pb2_grpc.add_ModelAdminServicer_to_server(FanOutAdmin(pools), server)  # to every replica

    async def start() -> None:
        listed = _listed(config)
        for role, addresses in listed.items():
            for address in addresses:
                pools.fleets[role].add(address)
        pools.start()
        await asyncio.gather(*(admit_listed(pools.fleets[role], addresses, config)
                               for role, addresses in listed.items() if addresses))  # the pools wait together
        for discovery in discoveries:
            # No waiting here: engine pods may load their model for minutes; the router's health
            # follows the routable set meanwhile.
            await discovery.refresh()
            discovery.start()
        pools.track_readiness()

    async def drain(deadline: float) -> None:
        # The server's gate waits for in-flight streams; replicas keep serving them.
        for discovery in discoveries:
            await discovery.stop()

    return run_service("router", config.common, add_servicers, on_start=start, on_drain=drain,
                       registry=metrics.REGISTRY, readiness=readiness)


def _listed(config: RouterConfig) -> dict[str, list[str]]:
    """The replicas given on the command line, by pool role."""
    if config.disaggregated:
        return {"prefill": list(config.prefill), "decode": list(config.decode)}
    return {"": list(config.replica_addrs)}


async def admit_listed(fleet: Fleet, addresses: list[str], config: RouterConfig) -> None:
    """Wait for the listed replicas of one pool; fail unless one was admitted. Refused ones (the
    wrong disaggregation mode) are named."""
    admitted = await fleet.wait_healthy(addresses, config.peer_wait_s)
    refused = {a: fleet.replicas[a].refused for a in addresses if a in fleet.replicas and fleet.replicas[a].refused}
    pool = f"{fleet.role} replica" if fleet.role else "replica"
    for address, why in refused.items():
        log.error(f"{pool} refused", extra={"replica": address, "reason": why})
    if not admitted:
        parts = [f"{a} refused: {why}" for a, why in refused.items()]
        late = [a for a in addresses if a not in refused]
        if late:
            parts.append(f"{', '.join(late)} not SERVING within {config.peer_wait_s}s")
        raise RuntimeError(f"no {pool} was admitted: " + "; ".join(parts))
    log.info("replicas ready", extra={"role": fleet.role, "admitted": admitted, "policy": fleet.policy.name,
                                      "missing": sorted(set(addresses) - set(admitted))})


def _discoveries(config: RouterConfig, pools: Pools) -> list[DnsDiscovery]:
    """One DNS discovery per pool given by name (--replica-dns; --prefill-dns, --decode-dns)."""
    targets = {"": config.replica_dns, "prefill": config.prefill_dns, "decode": config.decode_dns}
    wanted = {role: target for role, target in targets.items() if target is not None and role in pools.fleets}
    if not wanted:
        return []
    from services.router.discovery import DnsDiscovery

    return [DnsDiscovery(target, pools.fleets[role], interval_s=config.replica_dns_interval_s,
                         drain_wait_s=config.drain_wait_s) for role, target in wanted.items()]
