"""The router's view of its replicas: health, drain, load, breakers, and the policy's choice.

A replica (its tokenizer's address) is routable when it is healthy (its last
`healthy_threshold` grpc.health checks said SERVING), not draining, and its breaker lets
an attempt through. `unhealthy_threshold` failed checks in a row eject it; it is
re-admitted as soon as checks pass again. Its load, as policies see it, is the number of
requests this router has open on it, or what the replica itself reports queued and
running (GetLoad, polled every load_interval_s) when that is more (other routers, clients
that bypass this one). Everything here runs on the router's event loop.

The router's own readiness (its gRPC health, through `readiness`) follows the routable set:
NOT_SERVING from the moment no replica is routable (all drained, ejected or open-circuit),
SERVING again as soon as one is. `update_readiness()` runs at every change point (health
check result, drain/resume, add/remove, an attempt's end) and on each health tick (a breaker's
cooldown ends with time, not with an event), once `track_readiness()` was called (after
start-up, which has its own NOT_SERVING phase).

A fleet has a role (services/router/roles.py): "" for co-located replicas, "prefill" or
"decode" for one pool of a disaggregated fleet. Each time a replica is about to be admitted
(its health checks passed), its tokenizer's Info is read and kept (`Replica.info`: the model, a
prefill replica's bootstrap address); a replica whose Info reports another disaggregation mode
is refused instead (state "refused", the reason logged once and in `Replica.refused`), and
asked again at the next passing check.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import router_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common import tracing
from services.common.server import MAX_MESSAGE_BYTES, Readiness
from services.router import metrics
from services.router.breaker import STATE_VALUE, Breaker
from services.router.policies import Candidate, Choice, make_policy
from services.router.roles import COLOCATED, refusal

log = logging.getLogger(__name__)

PENDING, HEALTHY, EJECTED, DRAINING, REFUSED = "pending", "healthy", "ejected", "draining", "refused"

# A dead replica must be noticed and a restarted one found quickly: gRPC's default
# reconnect backoff grows to two minutes.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class Replica:
    def __init__(self, address: str, config, model_name: str, role: str = COLOCATED) -> None:
        self.address, self.role = address, role
        self.channel = tracing.channel(address, CHANNEL_OPTIONS)  # carries the trace when tracing is on
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self.stub_v2 = tokenizer2_grpc.TokenizerStub(self.channel)  # Generate, radixmesh.v2
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.breaker = Breaker(config.breaker_failures, config.breaker_cooldown_s)
        self.healthy = False
        self.ever_healthy = False
        self.draining = False
        self.passes = self.fails = 0  # consecutive health-check results
        self.in_flight = 0
        self.report = tokenizer_pb2.LoadReport()
        self.info: tokenizer_pb2.InfoResponse | None = None  # its Info when last admitted
        self.refused: str | None = None  # why its last admission was refused (roles.refusal)
        self.counts = {"routed": 0, "match": 0, "load": 0, "failures": 0, "ejections": 0}
        self.idle = asyncio.Event()
        self.idle.set()
        self._labels = (model_name, address)

    @property
    def state(self) -> str:
        if self.draining:
            return DRAINING
        if self.healthy:
            return HEALTHY
        if self.refused:
            return REFUSED
        return EJECTED if self.ever_healthy else PENDING

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.breaker.available()

    @property
    def load(self) -> int:
        return max(self.in_flight, self.report.num_running + self.report.num_waiting)

    def begin(self, reason: str) -> None:
        self.breaker.attempt()
        self.in_flight += 1
        self.idle.clear()
        self.counts["routed"] += 1
        self.counts[reason] += 1
        metrics.ROUTED.labels(*self._labels, reason).inc()
        metrics.IN_FLIGHT.labels(*self._labels).set(self.in_flight)

    def end(self, ok: bool | None, code: str = "") -> None:
        """ok=None: the attempt ended in a way that says nothing about the replica (client gone, bad input)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
        metrics.IN_FLIGHT.labels(*self._labels).set(self.in_flight)
        if ok:
            self.breaker.success()
        elif ok is False:
            self.breaker.failure()
            self.counts["failures"] += 1
            metrics.FAILURES.labels(*self._labels, code).inc()
        else:
            self.breaker.abandoned()
        metrics.CIRCUIT.labels(*self._labels).set(STATE_VALUE[self.breaker.state])

    def status(self, tree_chars: int = 0) -> router_pb2.ReplicaStatus:
        c = self.counts
        return router_pb2.ReplicaStatus(
            address=self.address, state=self.state, circuit=self.breaker.state, in_flight=self.in_flight,
            routed=c["routed"], routed_by_match=c["match"], routed_by_load=c["load"], failures=c["failures"],
            ejections=c["ejections"], load=self.report, tree_chars=tree_chars, role=self.role)


class Fleet:
    def __init__(self, config, readiness: Readiness | None = None, *, role: str = COLOCATED,
                 policy: str | None = None) -> None:
        """`role`: the disaggregation mode its replicas must report; `policy`: default config.policy.
        `readiness` is anything with `ready` and `set(ready, reason)` (services/router/pools.py)."""
        self.config, self.role = config, role
        self.readiness = readiness or Readiness()
        self._tracking = False  # update_readiness is a no-op until track_readiness()
        self.policy = make_policy(policy or config.policy, config, seed=config.seed)
        self.replicas: dict[str, Replica] = {}
        self.model_name = ""  # learned from a replica's Info; labels the metrics
        self._tasks: list[asyncio.Task] = []
        self.changed = asyncio.Event()  # set whenever a replica's health changes (tests, start-up)

    def add(self, address: str) -> Replica:
        if address in self.replicas:
            raise KeyError(address)
        replica = self.replicas[address] = Replica(address, self.config, self.model_name, self.role)
        log.info("replica added", extra={"replica": address})
        asyncio.ensure_future(self._check(replica))  # don't wait a whole interval to admit it
        self.update_readiness()
        return replica

    async def remove(self, address: str) -> Replica:
        replica = self.replicas.pop(address)
        self.policy.forget(address)
        metrics.forget(self.model_name, address)
        log.info("replica removed", extra={"replica": address, "in_flight": replica.in_flight})
        # Streams still open keep the channel until they end.
        asyncio.ensure_future(_close_when_idle(replica))
        self.update_readiness()
        return replica

    async def retire(self, address: str, timeout_s: float) -> None:
        """Drain `address` (no new work), wait up to `timeout_s` for its in-flight requests, then
        remove it: RemoveReplica without force. KeyError when it is not in the fleet."""
        replica = self.replicas[address]
        self.set_draining(replica, True)
        try:
            await asyncio.wait_for(replica.idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        if self.replicas.get(address) is replica:  # not removed (or replaced) meanwhile
            await self.remove(address)

    def resume(self, address: str) -> None:
        """Undo a drain (no-op for an address not in the fleet)."""
        replica = self.replicas.get(address)
        if replica is not None:
            self.set_draining(replica, False)

    def set_draining(self, replica: Replica, draining: bool) -> None:
        replica.draining = draining
        self.update_readiness()

    def track_readiness(self) -> None:
        """From now on keep `readiness` in step with the routable set (start-up is over)."""
        self._tracking = True
        self.update_readiness()

    def update_readiness(self) -> None:
        """Mirror "some replica is routable" into the router's health (no-op when unchanged)."""
        if not self._tracking:
            return
        routable = any(r.routable for r in self.replicas.values())
        if routable == self.readiness.ready:
            return
        if routable:
            self.readiness.set(True)
            return
        states = ", ".join(f"{r.address} {r.state}/{r.breaker.state}" for r in self.replicas.values())
        self.readiness.set(False, f"no replica is routable ({states or 'the fleet is empty'})")

    def choose(self, key: str, exclude: set[str], adapter: str = "") -> tuple[Replica, Choice] | None:
        """The replica for the next attempt, preferring ones not in `exclude` (already failed
        for this request), then, for a LoRA adapter's request, ones that report the adapter
        resident in a slot (its last load report: no swap-in before the request runs); None
        when no replica may take work."""
        routable = [r for r in self.replicas.values() if r.routable]
        fresh = [r for r in routable if r.address not in exclude] or routable
        if not fresh:
            return None
        if adapter:
            fresh = [r for r in fresh if adapter in r.report.resident_adapters] or fresh
        fresh.sort(key=lambda r: r.address)
        choice = self.policy.choose(key, [Candidate(r.address, r.load) for r in fresh])
        replica = self.replicas[choice.address]
        self.policy.routed(key, choice.address)
        replica.begin(choice.reason)
        return replica, choice

    # --- background loops -------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._every(self.config.health_interval_s, self._check_all)),
                       asyncio.create_task(self._every(self.config.load_interval_s, self._poll_loads)),
                       asyncio.create_task(self._every(self.config.eviction_interval_s, self._evict))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.channel.close() for r in self.replicas.values()), return_exceptions=True)

    @staticmethod
    async def _every(interval: float, tick) -> None:
        while True:
            try:
                await tick()
            except Exception:  # a loop that dies silently would stop health checking for good
                log.exception("router background task failed; continuing")
            await asyncio.sleep(interval)

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
        self.update_readiness()

    async def _check(self, replica: Replica) -> None:
        try:
            resp = await replica.health.Check(health_pb2.HealthCheckRequest(), timeout=self.config.health_timeout_s)
            ok, why = resp.status == health_pb2.HealthCheckResponse.SERVING, "not SERVING"
        except grpc.aio.AioRpcError as e:
            ok, why = False, f"{e.code().name}: {e.details()}"
        if replica.address not in self.replicas:
            return
        if ok:
            replica.passes, replica.fails = replica.passes + 1, 0
            if not replica.healthy and replica.passes >= self.config.healthy_threshold \
                    and await self._admit(replica):
                replica.healthy = replica.ever_healthy = True
                log.info("replica admitted", extra={"replica": replica.address, "role": self.role})
                self.changed.set()
                self.update_readiness()
        else:
            replica.fails, replica.passes = replica.fails + 1, 0
            if replica.healthy and replica.fails >= self.config.unhealthy_threshold:
                replica.healthy = False
                replica.counts["ejections"] += 1
                metrics.EJECTIONS.labels(self.model_name, replica.address).inc()
                log.warning("replica ejected", extra={"replica": replica.address, "reason": why})
                self.changed.set()
                self.update_readiness()
        metrics.HEALTHY.labels(self.model_name, replica.address).set(1 if replica.healthy else 0)

    async def _admit(self, replica: Replica) -> bool:
        """Read the replica's Info; False (and `refused` set) when its mode is not this pool's role."""
        info, error = await _info(replica.stub, self.config.health_timeout_s)
        if info is not None and not self.model_name:
            self.model_name = info.model_name
            for r in self.replicas.values():
                r._labels = (self.model_name, r.address)
        why = refusal(self.role, info, error)
        if why is not None:
            if why != replica.refused:
                log.warning("replica refused", extra={"replica": replica.address, "role": self.role, "reason": why})
                replica.refused = why
                self.changed.set()
            return False
        replica.info, replica.refused = info, None
        return True

    async def _poll_loads(self) -> None:
        async def poll(replica: Replica) -> None:
            try:
                replica.report = await replica.stub.GetLoad(tokenizer_pb2.GetLoadRequest(),
                                                            timeout=self.config.health_timeout_s)
            except grpc.aio.AioRpcError:
                return  # health checks decide about ejection; keep the last report
            labels = (self.model_name, replica.address)
            metrics.CACHE_HIT_RATE.labels(*labels).set(replica.report.cache_hit_rate)
            metrics.QUEUE.labels(*labels).set(replica.report.num_running + replica.report.num_waiting)
            metrics.CIRCUIT.labels(*labels).set(STATE_VALUE[replica.breaker.state])

        await asyncio.gather(*(poll(r) for r in self.replicas.values() if r.healthy))

    async def _evict(self) -> None:
        self.policy.maintain()

    def tree_chars(self, address: str) -> int:
        tree = getattr(self.policy, "tree", None)
        return tree.sizes.get(address, 0) if tree is not None else 0

    async def probe(self, address: str) -> str | None:
        """Why `address` may not join (None: its health service answered SERVING and its Info the
        mode of this fleet's role). The channel is the fleet's own, so with --tls-ca a server
        without a certificate from that CA fails here."""
        async with tracing.channel(address, CHANNEL_OPTIONS) as channel:
            try:
                resp = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=self.config.health_timeout_s)
            except grpc.aio.AioRpcError as e:
                return f"its health service did not answer ({e.code().name}: {e.details()})"
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                return f"its health service answered {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
            info, error = await _info(tokenizer_pb2_grpc.TokenizerStub(channel), self.config.health_timeout_s)
        return refusal(self.role, info, error)

    async def wait_healthy(self, addresses: list[str], timeout_s: float) -> list[str]:
        """Wait until each of `addresses` has been admitted or refused (or the timeout); returns
        those admitted."""
        deadline = time.monotonic() + timeout_s
        while True:
            known = [self.replicas[a] for a in addresses if a in self.replicas]
            admitted = [r.address for r in known if r.healthy]
            settled = [r for r in known if r.healthy or r.refused]
            left = deadline - time.monotonic()
            if len(settled) == len(addresses) or left <= 0:
                return admitted
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass


async def _info(stub: tokenizer_pb2_grpc.TokenizerStub,
                timeout_s: float) -> tuple[tokenizer_pb2.InfoResponse | None, str]:
    """A replica's Info, or None and why it failed."""
    try:
        return await stub.Info(tokenizer_pb2.InfoRequest(), timeout=timeout_s), ""
    except grpc.aio.AioRpcError as e:
        return None, f"{e.code().name}: {e.details()}"


async def _close_when_idle(replica: Replica) -> None:
    await replica.idle.wait()
    await replica.channel.close()
