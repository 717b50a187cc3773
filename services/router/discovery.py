"""Replicas discovered through DNS: a name (a Kubernetes headless Service) whose addresses are the replicas.

Every `interval_s` the name is resolved; an address that appeared is added to the fleet (admitted
once its health checks pass, like AddReplica), one that vanished is drained and then removed, like
RemoveReplica without force: no new work, in-flight requests get up to `drain_wait_s`. A replica
that comes back while it drains is resumed instead. Discovery only ever removes what it added:
`--replica-addrs` entries and replicas added through the admin RPC are left alone.

A failed lookup (DNS down, NXDOMAIN while the Service has no endpoints) keeps the current set and
logs a warning: an outage of DNS must not empty the fleet. Health checks still eject replicas that
really went away.

The lookup is injectable (`resolve`): tests pass a fake; the default asks the system resolver for
A records, and for AAAA records only when there are none (a dual-stack pod has both, and must not
count twice).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

log = logging.getLogger(__name__)

# (host, port) -> the replicas' addresses, "IP:PORT" ("[IPv6]:PORT"); raises OSError when the lookup fails.
Resolver = Callable[[str, int], Awaitable[set[str]]]


async def resolve_addresses(host: str, port: int) -> set[str]:
    """`host`'s addresses as "IP:PORT": IPv4 when it has any, else IPv6. Raises OSError (socket.gaierror)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = {f"{info[4][0]}:{port}" for info in infos if info[0] == socket.AF_INET}
    v6 = {f"[{info[4][0]}]:{port}" for info in infos if info[0] == socket.AF_INET6}
    return v4 or v6


def split_target(target: str) -> tuple[str, int]:
    """"NAME:PORT" -> (NAME, PORT); ValueError when it is not that."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected NAME:PORT, got {target!r}")
    return host, int(port)


class FleetOps(Protocol):
    """What discovery needs of the fleet (services/router/fleet.py's Fleet has it)."""

    replicas: dict

    def add(self, address: str) -> object: ...

    async def retire(self, address: str, timeout_s: float) -> None: ...

    def resume(self, address: str) -> None: ...


@dataclass
class Change:
    """What one refresh did (for logs and tests); `failed` when the lookup failed and nothing changed."""
    added: list[str] = field(default_factory=list)
    removing: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    failed: bool = False


class DnsDiscovery:
    def __init__(self, target: str, fleet: FleetOps, *, interval_s: float, drain_wait_s: float,
                 resolve: Resolver = resolve_addresses) -> None:
        self.host, self.port = split_target(target)
        self.fleet, self.interval_s, self.drain_wait_s = fleet, interval_s, drain_wait_s
        self.resolve = resolve
        self.owned: set[str] = set()  # addresses this discovery added and has not removed
        self.removing: dict[str, asyncio.Task] = {}  # address -> its drain-then-remove task
        self._task: asyncio.Task | None = None

    async def refresh(self) -> Change:
        """One lookup, applied to the fleet."""
        try:
            found = await self.resolve(self.host, self.port)
        except OSError as e:
            log.warning("replica DNS lookup failed; keeping the current replicas", extra={
                "dns_name": self.host, "error": str(e), "replicas": sorted(self.owned)})
            return Change(failed=True)
        change = Change()
        # A replica removed through the admin RPC while DNS still lists it comes back: DNS is the
        # source of truth here (DrainReplica keeps one out without removing it).
        self.owned &= set(self.fleet.replicas) | set(self.removing)
        self._resume_returning(found, change)
        for address in sorted(found - self.owned):
            self._appear(address, change)
        for address in sorted(self.owned - found - set(self.removing)):
            self._vanish(address, change)
        if change.added or change.removing or change.resumed:
            log.info("replica DNS changed", extra={"dns_name": self.host, "added": change.added,
                                                    "removing": change.removing, "resumed": change.resumed})
        return change

    def _appear(self, address: str, change: Change) -> None:
        if address in self.fleet.replicas:
            return  # added by --replica-addrs or the admin RPC: theirs, not ours
        self.fleet.add(address)
        self.owned.add(address)
        change.added.append(address)

    def _vanish(self, address: str, change: Change) -> None:
        self.removing[address] = asyncio.create_task(self._retire(address))
        change.removing.append(address)

    async def _retire(self, address: str) -> None:
        try:
            await self.fleet.retire(address, self.drain_wait_s)
        except KeyError:
            pass  # already removed through the admin RPC
        except Exception:
            log.exception("retiring a replica that left DNS failed", extra={"replica": address})
        # Not reached when cancelled: the replica came back and was resumed (_resume_returning).
        self.owned.discard(address)
        self.removing.pop(address, None)

    def _resume_returning(self, found: set[str], change: Change) -> None:
        for address in sorted(found & set(self.removing)):
            self.removing.pop(address).cancel()
            self.fleet.resume(address)
            change.resumed.append(address)

    # --- the loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop looking (drains in progress go on: their replicas must still finish what they run)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # a loop that dies silently would stop discovery for good
                log.exception("replica DNS refresh failed; continuing")
