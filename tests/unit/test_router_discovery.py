"""The router's DNS discovery (services/router/discovery.py) against a real Fleet and a fake resolver:
adds, drained removals, resumption, a failed lookup keeping the set; and one real lookup of localhost."""
from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from services.router.config import RouterConfig
from services.router.discovery import DnsDiscovery, resolve_addresses, split_target
from services.router.fleet import Fleet

# Loopback addresses nobody listens on: health checks fail fast, no network is touched.
A, B, C = "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"


class FakeResolver:
    """Answers with `answer`, or raises `error`; counts the lookups."""

    def __init__(self, *addresses: str) -> None:
        self.answer, self.error, self.calls = set(addresses), None, []

    async def __call__(self, host: str, port: int) -> set[str]:
        self.calls.append((host, port))
        if self.error is not None:
            raise self.error
        return set(self.answer)


@pytest.fixture
async def fleet():
    fleet = Fleet(RouterConfig(health_interval_s=60, load_interval_s=60))
    yield fleet
    await fleet.stop()


def discovery(fleet: Fleet, resolver: FakeResolver, drain_wait_s: float = 5.0) -> DnsDiscovery:
    return DnsDiscovery("engine.ns.svc:1", fleet, interval_s=0.01, drain_wait_s=drain_wait_s, resolve=resolver)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_new_addresses_are_added(fleet):
    resolver = FakeResolver(A, B)
    d = discovery(fleet, resolver)
    change = await d.refresh()
    assert change.added == [A, B] and set(fleet.replicas) == {A, B}
    assert resolver.calls == [("engine.ns.svc", 1)]
    resolver.answer.add(C)
    assert (await d.refresh()).added == [C]
    assert (await d.refresh()).added == []  # nothing new, nothing done


async def test_a_vanished_replica_drains_until_idle_then_is_removed(fleet):
    resolver = FakeResolver(A, B)
    d = discovery(fleet, resolver)
    await d.refresh()
    fleet.replicas[B].begin("load")  # one request in flight on B
    resolver.answer = {A}
    assert (await d.refresh()).removing == [B]
    await settle()
    assert fleet.replicas[B].draining and not fleet.replicas[B].routable  # no new work, not forgotten yet
    assert (await d.refresh()).removing == []  # already on its way out
    fleet.replicas[B].end(True)
    await settle()
    assert set(fleet.replicas) == {A} and d.owned == {A} and not d.removing


async def test_the_drain_wait_bounds_a_removal(fleet):
    resolver = FakeResolver(A)
    d = discovery(fleet, resolver, drain_wait_s=0.05)
    await d.refresh()
    fleet.replicas[A].begin("load")  # never ends
    resolver.answer = set()
    await d.refresh()
    await asyncio.wait_for(asyncio.gather(*d.removing.values()), 2)
    assert fleet.replicas == {}


async def test_a_replica_back_in_dns_while_draining_is_resumed(fleet):
    resolver = FakeResolver(A)
    d = discovery(fleet, resolver)
    await d.refresh()
    replica = fleet.replicas[A]
    replica.begin("load")
    resolver.answer = set()
    await d.refresh()
    await settle()
    assert replica.draining
    resolver.answer = {A}
    change = await d.refresh()
    assert change.resumed == [A] and change.added == []
    replica.end(True)
    await settle()
    assert fleet.replicas.get(A) is replica and not replica.draining and d.owned == {A}


async def test_a_failed_lookup_keeps_the_current_set_and_logs(fleet, caplog):
    resolver = FakeResolver(A, B)
    d = discovery(fleet, resolver)
    await d.refresh()
    resolver.error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    with caplog.at_level(logging.WARNING, logger="services.router.discovery"):
        change = await d.refresh()
    assert change.failed and not change.removing
    assert set(fleet.replicas) == {A, B} and not any(r.draining for r in fleet.replicas.values())
    assert "replica DNS lookup failed" in caplog.text
    resolver.error = None
    resolver.answer = {A}
    assert (await d.refresh()).removing == [B]  # the next good answer applies


async def test_only_replicas_it_added_are_removed(fleet):
    fleet.add(C)  # --replica-addrs or the admin RPC
    resolver = FakeResolver(A, C)
    d = discovery(fleet, resolver)
    assert (await d.refresh()).added == [A]
    resolver.answer = set()
    assert (await d.refresh()).removing == [A]
    await settle()
    assert C in fleet.replicas and not fleet.replicas[C].draining


async def test_a_replica_removed_by_admin_comes_back_while_dns_lists_it(fleet):
    resolver = FakeResolver(A)
    d = discovery(fleet, resolver)
    await d.refresh()
    await fleet.remove(A)
    assert (await d.refresh()).added == [A]


async def test_the_loop_runs_until_stopped(fleet):
    resolver = FakeResolver(A)
    d = discovery(fleet, resolver)
    d.start()
    await asyncio.sleep(0.1)
    await d.stop()
    calls = len(resolver.calls)
    assert calls >= 2 and set(fleet.replicas) == {A}
    await asyncio.sleep(0.05)
    assert len(resolver.calls) == calls


def test_config_validates_the_dns_flags():
    assert RouterConfig(replica_dns="engine.ns.svc.cluster.local:50051").replica_dns_interval_s == 5.0
    for bad in ("engine", "engine:", ":50051", "engine:http"):
        with pytest.raises(ValueError, match="--replica-dns"):
            RouterConfig(replica_dns=bad)
    with pytest.raises(ValueError, match="--replica-dns-interval-s"):
        RouterConfig(replica_dns="engine:1", replica_dns_interval_s=0)
    assert split_target("engine.ns:50051") == ("engine.ns", 50051)


async def test_resolving_localhost_for_real():
    """The system resolver (/etc/hosts): localhost's IPv4 address, once, with the port."""
    found = await resolve_addresses("localhost", 50051)
    assert "127.0.0.1:50051" in found
    assert all(a.endswith(":50051") for a in found) and not any(a.startswith("[") for a in found)
    with pytest.raises(socket.gaierror):  # the resolver's own "no such name"
        await resolve_addresses("no-such-host.invalid", 50051)


async def test_a_vanished_replica_already_removed_by_admin_is_forgotten(fleet):
    resolver = FakeResolver(A)
    d = discovery(fleet, resolver)
    await d.refresh()
    resolver.answer = set()
    await d.refresh()  # its retirement is scheduled, not started
    await fleet.remove(A)
    await asyncio.wait_for(asyncio.gather(*d.removing.values()), 2)
    assert fleet.replicas == {} and d.owned == set() and not d.removing
