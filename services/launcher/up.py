"""`radixmesh up`: the whole mesh on this machine, one process per service, on loopback.

    radixmesh up [--model PATH] [--http-port 8000] [--no-gateway] [service flags...]
    radixmesh up --replicas 2 [--policy cache_aware] [router flags...]   # a fleet behind the router
    radixmesh up --prefill 1 --decode 1 [--transfer-backend grpc]        # a disaggregated fleet (launcher/pd.py)

Starts the worker, the scheduler (once the worker listens), the detokenizer (which
reads the scheduler's outputs), the tokenizer, and the gateway, each with `--listen 127.0.0.1:0` (the port a
child bound is read from its `listening` log line) and its peers' addresses;
waits until every one reports SERVING over gRPC health; prints the URL;
supervises. With `--replicas N` (N > 1, or `--router`) it starts N replicas (children
`worker-0`, `tokenizer-0`, ..., `-N-1`), then `router` with every tokenizer in
`--replica-addrs`, and points the gateway at the router. With `--prefill N --decode M` the
replicas are `worker-prefill-0`, ..., `tokenizer-decode-{M-1}`, their workers and schedulers get
`--disaggregation-mode`, and the router pairs them (`--prefill ... --decode ...`; no kvstore
unless `--kvstore`). If a child dies, the others are stopped and the launcher exits 1 naming
it, with its exit status and last log lines (fail-fast, the default). With
`--restart-on-failure` a child that dies once the mesh is up is restarted instead, in place:
same flags and the same address (the launcher pins the port it first bound, so its peers'
channels reconnect to it: a restarted worker rejoins its scheduler), after a backoff of
`--restart-backoff-s` doubled on each consecutive try (at most 30 s); after
`--restart-max-tries` consecutive failed tries (a child that stays up 60 s starts its count
afresh) the launcher gives up and stops the mesh as in fail-fast. SIGTERM / Ctrl-C stops
the mesh front to back (gateway, tokenizer, scheduler + detokenizer, worker),
each stage draining its in-flight requests before the next one is told; a
child still running `--drain-timeout-s` + `--kill-grace-s` after its SIGTERM
is SIGKILLed with its process group. A second signal hurries the drain.

Flags the launcher does not know are forwarded to every service whose config
accepts them (`--kv-cache-bytes` to the worker, `--max-running-requests` to
the scheduler, `--log-level` to all); a flag no service accepts is an error.
The gateway gets `--listen`, `--http-port` and `--tokenizer-addr`, plus the
forwarded flags its `services.gateway.main.CONFIG_CLASS` accepts, if it has one.

`--metrics-port N` gives every gRPC service its own Prometheus port: N, N+1, ... in start
order (kvstore, then per replica worker, scheduler, detokenizer, tokenizer, then the router),
printed when the mesh is up; 0 gives each a free port. The gateway serves /metrics on its
HTTP port.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import importlib
import logging
import signal
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import tls
from services.common.config import config_from_args, flags_from_dataclass
from services.common.logging import setup_logging
from services.launcher import pd
from services.launcher.children import Child

log = logging.getLogger("radixmesh.up")

RESTART_BACKOFF_CAP_S = 30.0
RESTART_RESET_S = 60.0  # a child up this long since its restart starts its count of tries afresh

# (service, [(flag, peer whose address it takes)]), in start order: one replica, then the gateway.
TOPOLOGY = [
    ("worker", []),
    ("scheduler", [("--worker-addr", "worker")]),
    ("detokenizer", [("--scheduler-addr", "scheduler")]),
    ("tokenizer", [("--scheduler-addr", "scheduler"), ("--detokenizer-addr", "detokenizer")]),
    ("gateway", [("--tokenizer-addr", "tokenizer")]),
]
STOP_ORDER = [["gateway"], ["tokenizer"], ["scheduler", "detokenizer"], ["worker"]]  # one replica, by service
FLEET_STOP_ORDER = [STOP_ORDER[0], ["router"], *STOP_ORDER[1:], ["kvstore"]]  # the router right after the gateway
TAKES_MODEL = ("worker", "detokenizer", "tokenizer")
CONFIG_CLASSES = {
    "worker": "services.worker.main:WorkerServiceConfig",
    "detokenizer": "services.detokenizer.main:DetokenizerServiceConfig",
    "scheduler": "services.scheduler.main:SchedulerServiceConfig",
    "tokenizer": "services.tokenizer.main:TokenizerServiceConfig",
    "gateway": "services.gateway.main:CONFIG_CLASS",
    "router": "services.router.config:RouterConfig",
    "kvstore": "services.kvstore.main:KVStoreConfig",
}
SET_BY_LAUNCHER = {"--listen", "--replica-addrs", "--kvstore-addr", "--prefill", "--decode", "--dp-rank",
                   *(flag for _, peers in TOPOLOGY for flag, _ in peers)}


@dataclass(frozen=True)
class Planned:
    """One child: its name (unique), the service it runs, (flag, [peer child names]), and its
    replica's disaggregation role ("" = co-located)."""
    name: str
    service: str
    peers: list[tuple[str, list[str]]]
    role: str = ""
    flags: tuple[str, ...] = ()  # fixed flags of its own (a data-parallel scheduler's --dp-rank)


def worker_threads(replicas: int, cores: int | None = None) -> int:
    """Intra-op threads per worker when `replicas` workers share this machine's cores."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // replicas)


def dp_lanes(extra: list[str]) -> int:
    """The worker's data-parallel attention ranks its argv asks for (--enable-dp-attention --dp-size N), else 1."""
    if "--enable-dp-attention" not in extra:
        return 1
    for i, token in enumerate(extra):
        if token.startswith("--dp-size="):
            return int(token.split("=", 1)[1])
        if token == "--dp-size" and i + 1 < len(extra):
            return int(extra[i + 1])
    return 1


def dp_plan(lanes: int, gateway: bool) -> list[Planned]:
    """One worker group with data-parallel attention: the worker, then per rank i a scheduler
    (--dp-rank i, on the worker's Step stream for rank i), detokenizer and tokenizer, the router in
    front of the ranks' tokenizers (cache-aware, as in front of replicas), then the gateway."""
    out = [Planned("worker", "worker", [])]
    for i in range(lanes):
        sfx = f"-dp{i}"
        for service, peers in TOPOLOGY[1:-1]:
            links = [(flag, [peer if peer == "worker" else peer + sfx]) for flag, peer in peers]
            out.append(Planned(service + sfx, service, links, flags=("--dp-rank", str(i)) if service == "scheduler"
                               else ()))
    out.append(Planned("router", "router", [("--replica-addrs", [f"tokenizer-dp{i}" for i in range(lanes)])]))
    if gateway:
        out.append(Planned("gateway", "gateway", [("--tokenizer-addr", ["router"])]))
    return out


def plan(replicas: int, router: bool, gateway: bool, kvstore: bool = False, prefill: int = 0,
         decode: int = 0, dp: int = 1) -> list[Planned]:
    """The children in start order. One replica without a router keeps the plain names.
    With a kvstore, it starts first and every worker gets --kvstore-addr. With `prefill` and
    `decode` (> 0) the replicas are those of a disaggregated fleet (services/launcher/pd.py);
    with `dp` > 1, one worker group's data-parallel attention ranks (dp_plan)."""
    if dp > 1:
        if replicas > 1 or prefill or decode or kvstore:
            raise ValueError("--enable-dp-attention runs one worker group with a scheduler per rank: give no "
                             "--replicas, --prefill/--decode or --kvstore with it")
        return dp_plan(dp, gateway)
    if prefill or decode:
        suffixes = pd.pd_replicas(prefill, decode)
    else:
        suffixes = [("", "")] if replicas == 1 and not router else [(f"-{i}", "") for i in range(replicas)]
    out = [Planned("kvstore", "kvstore", [])] if kvstore else []
    for sfx, role in suffixes:
        for service, peers in TOPOLOGY:
            if service != "gateway":
                links = [(flag, [peer + sfx]) for flag, peer in peers]
                if kvstore and service == "worker":
                    links.append(("--kvstore-addr", ["kvstore"]))
                out.append(Planned(service + sfx, service, links, role))
    front = "tokenizer"
    if prefill or decode:
        out.append(Planned("router", "router", [
            (f"--{role}", [f"tokenizer{s}" for s, r in suffixes if r == role]) for role in (pd.PREFILL, pd.DECODE)]))
        front = "router"
    elif router or replicas > 1:
        out.append(Planned("router", "router", [("--replica-addrs", [f"tokenizer{s}" for s, _ in suffixes])]))
        front = "router"
    if gateway:
        out.append(Planned("gateway", "gateway", [("--tokenizer-addr", [front])]))
    return out


def metrics_ports(planned: list[Planned], first: int | None) -> dict[str, int]:
    """Each gRPC service's --metrics-port: `first`, first+1, ... in start order (0: all 0, each
    picks a free one). The gateway has none: it serves /metrics on its HTTP port."""
    if first is None:
        return {}
    names = [p.name for p in planned if p.service != "gateway"]
    if first and first + len(names) - 1 > 65535:
        raise ValueError(f"--metrics-port {first} leaves no room for {len(names)} ports (one per service) "
                         "below 65536")
    return {name: first + i if first else 0 for i, name in enumerate(names)}


@dataclass(frozen=True)
class UpConfig:
    model: str | None = field(default=None, metadata={"help": "a .gguf file or HF directory; default: SmolLM2-135M-Instruct"})
    http_port: int = field(default=8000, metadata={"help": "the gateway's HTTP port"})
    gateway: bool = field(default=True, metadata={"help": "start the HTTP gateway (--no-gateway: gRPC only, at the tokenizer)"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "each service's drain deadline on stop"})
    kill_grace_s: float = field(default=5.0, metadata={"help": "SIGKILL a child this long after its drain deadline"})
    start_timeout_s: float = field(default=900.0, metadata={"help": "give up if the mesh is not SERVING by then"})
    replicas: int = field(default=1, metadata={
        "help": "engine replicas (tokenizer + scheduler + worker + detokenizer each); more than 1 starts the "
                "router in front of them (its flags, e.g. --policy, are forwarded)"})
    router: bool = field(default=False, metadata={"help": "start the router even in front of one replica"})
    prefill: int = field(default=0, metadata={
        "help": "a disaggregated fleet: this many prefill replicas (whole replicas whose worker and scheduler run "
                "--disaggregation-mode prefill), with --decode; the router pairs one of each per request "
                "(docs/router.md; router flags such as --prefill-policy are forwarded); replaces --replicas"})
    decode: int = field(default=0, metadata={
        "help": "a disaggregated fleet: this many decode replicas (--disaggregation-mode decode), with --prefill"})
    transfer_backend: str = field(default="grpc", metadata={
        "help": "with --prefill/--decode: how the KV crosses from a prefill worker to a decode worker (the "
                "workers' --disaggregation-transfer-backend)", "choices": pd.TRANSFER_BACKENDS})
    kvstore: bool | None = field(default=None, metadata={
        "help": "start a kvstore and wire every replica's worker to it, so a prefix one replica computed serves "
                "the others (its flags, e.g. --kvstore-disk-dir, are forwarded); default: on when --replicas > 1"})

    metrics_port: int | None = field(default=None, metadata={
        "help": "the first Prometheus port: every gRPC service gets its own, N, N+1, ... in start order (kvstore, "
                "then per replica worker, scheduler, detokenizer, tokenizer, then router), printed at start; "
                "0 = a free port each; the gateway serves /metrics on its HTTP port; none = no metrics endpoints"})
    restart_on_failure: bool = field(default=False, metadata={
        "help": "restart a child that dies once the mesh is up, on its address, with exponential backoff, instead "
                "of stopping the whole mesh (the default: fail fast, exit 1)"})
    restart_max_tries: int = field(default=5, metadata={
        "help": "with --restart-on-failure: consecutive restarts of one child before giving up (then fail fast)"})
    restart_backoff_s: float = field(default=1.0, metadata={
        "help": "with --restart-on-failure: the wait before the first restart, doubled on each consecutive try "
                f"(at most {RESTART_BACKOFF_CAP_S:g}s)"})

    pin_lead_cpu: str = field(default="auto", metadata={
        "help": "a CPU kept for the worker's decode-step lead thread: the worker gets --lead-cpu and every other "
                "service starts on the other CPUs (one replica; services/worker/lead_cpu.py). auto (default): the "
                "last of this process's CPUs when the mesh runs one replica on at least 2 CPUs (single-stream ITL "
                "-10%, 64-concurrent throughput unchanged: docs/benchmarks.md, issue 41), else none; off: no "
                "pinning; N: CPU N"})

    @property
    def use_kvstore(self) -> bool:
        return self.replicas > 1 if self.kvstore is None else self.kvstore

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    @property
    def engine_replicas(self) -> int:
        """Replicas sharing this machine, whatever their role."""
        return self.prefill + self.decode if self.disaggregated else self.replicas

    @property
    def starts_router(self) -> bool:
        return self.replicas > 1 or self.router or self.disaggregated

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if self.drain_timeout_s < 0 or self.kill_grace_s < 0 or self.start_timeout_s <= 0:
            raise ValueError("--drain-timeout-s and --kill-grace-s must be >= 0, --start-timeout-s > 0")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        pd.check_counts(self.prefill, self.decode, self.replicas)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.restart_max_tries < 1 or self.restart_backoff_s < 0:
            raise ValueError("--restart-max-tries must be >= 1 and --restart-backoff-s >= 0, got "
                             f"{self.restart_max_tries} and {self.restart_backoff_s}")
        self.lead_cpu  # noqa: B018  (checked now: a bad choice is a usage error before anything starts)

    @property
    def lead_cpu(self) -> int | None:
        """--pin-lead-cpu resolved: the CPU kept for the worker's step lead, or None."""
        from services.worker.lead_cpu import other_cpus
        choice = self.pin_lead_cpu.strip().lower()
        if choice == "off":
            return None
        allowed = os.sched_getaffinity(0)
        if choice == "auto":
            return max(allowed) if self.engine_replicas == 1 and len(allowed) >= 2 else None
        try:
            lead = int(choice)
        except ValueError:
            raise ValueError(f"--pin-lead-cpu must be auto, off or a CPU number, got {self.pin_lead_cpu!r}") from None
        if self.engine_replicas != 1:
            raise ValueError("--pin-lead-cpu serves one replica")
        other_cpus(lead, allowed)
        return lead


class ChildDied(Exception):
    def __init__(self, child: Child) -> None:
        super().__init__(child.name)
        self.child = child


class Interrupted(Exception):
    """SIGTERM / SIGINT asked the launcher to stop."""


def load_ref(ref: str):
    """`module:attr` → the object; None when that module (not one it imports) or attribute is missing."""
    module, attr = ref.split(":")
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def _option_strings(cls) -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    flags_from_dataclass(cls, parser)
    return {s for action in parser._actions for s in action.option_strings}


def route_flags(extra: list[str], services: list[str]) -> dict[str, list[str]]:
    """Split unknown argv into `--flag [values]` groups, each forwarded to every service that
    accepts it. Raises ValueError for a stray value, a flag the launcher sets, or one no service knows."""
    routed: dict[str, list[str]] = {name: [] for name in services}
    if not extra:
        return routed
    groups: list[list[str]] = []
    for token in extra:
        if token.startswith("--"):
            groups.append([token])
        elif groups:
            groups[-1].append(token)
        else:
            raise ValueError(f"unexpected argument {token!r}")
    accepted = {name: _option_strings(cls) if (cls := load_ref(CONFIG_CLASSES[name])) else set()
                for name in services}
    for group in groups:
        flag = group[0].split("=", 1)[0]
        if flag in SET_BY_LAUNCHER:
            raise ValueError(f"{flag} is set by radixmesh up")
        takers = [name for name in services if flag in accepted[name]]
        if not takers:
            raise ValueError(f"no service accepts {flag} (see `radixmesh serve <service> -h`)")
        for name in takers:
            routed[name] += group
    return routed


class Mesh:
    def __init__(self, config: UpConfig, routed: dict[str, list[str]], dp: int = 1) -> None:
        self.config, self.routed = config, routed
        self.plan = plan(config.replicas, config.router, "gateway" in routed, config.use_kvstore,
                         config.prefill, config.decode, dp)
        self.metrics_ports = metrics_ports(self.plan, config.metrics_port)
        # Children that advertise their own address get a port before they start (pd.py).
        self.known_ports = {p.name: pd.free_loopback_port() for p in self.plan
                            if pd.needs_known_port(p.service, p.role)}
        self.children: dict[str, Child] = {}
        self.tries: dict[str, int] = {}  # consecutive restarts per child
        self.started_at: dict[str, float] = {}
        self.exits: dict[str, asyncio.Task] = {}
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()

    def on_signal(self) -> None:
        if self.stop.is_set():  # a second signal: children skip their drain wait
            self.hurry.set()
            for child in self.children.values():
                child.signal(signal.SIGTERM)
        self.stop.set()

    async def race(self, awaitable, timeout: float | None, what: str, watch: list[str] | None = None):
        """Await `awaitable` unless a child (of `watch`, default all) exits or a stop is asked for first."""
        task = asyncio.ensure_future(awaitable)
        stopping = asyncio.ensure_future(self.stop.wait())
        exits = {name: t for name, t in self.exits.items() if watch is None or name in watch}
        try:
            await asyncio.wait({task, stopping, *exits.values()}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        if self.stop.is_set():
            raise Interrupted()
        for name, exited in exits.items():
            if exited.done():
                raise ChildDied(self.children[name])
        raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")

    def _argv(self, name: str, peers: list[tuple[str, list[str]]], child: str = "") -> list[str]:
        """Flags of child `child` running service `name`."""
        cfg = self.config
        listen = f"127.0.0.1:{self.known_ports.get(child, 0)}"
        argv = ["--listen", listen]
        for flag, names in peers:
            argv += [flag, *(self.children[peer].address for peer in names)]
        if name == "gateway":
            argv += ["--http-port", str(cfg.http_port)]
            if load_ref(CONFIG_CLASSES["gateway"]) is not None:
                argv += ["--drain-timeout-s", str(cfg.drain_timeout_s)]
        else:
            argv += ["--drain-timeout-s", str(cfg.drain_timeout_s)]
        if name in TAKES_MODEL and cfg.model:
            argv += ["--model", cfg.model]
        routed = self.routed.get(name, [])
        if child in self.metrics_ports:
            argv += ["--metrics-port", str(self.metrics_ports[child])]
        if name == "worker" and cfg.lead_cpu is not None:
            argv += ["--lead-cpu", str(cfg.lead_cpu)]
        if name == "worker" and cfg.engine_replicas > 1 and "--num-threads" not in routed:
            # N workers on one machine: split the cores instead of oversubscribing them
            # (each OpenMP team spinning on all cores slows every worker several-fold).
            argv += ["--num-threads", str(worker_threads(cfg.engine_replicas))]
        argv += pd.disaggregation_flags(name, self._role(child), cfg.transfer_backend, listen)
        argv += next((list(p.flags) for p in self.plan if p.name == child), [])
        return argv + routed

    def _role(self, child: str) -> str:
        return next((p.role for p in self.plan if p.name == child), "")

    def _cpus(self, service: str) -> set[int] | None:
        """With --pin-lead-cpu every service but the worker runs off the lead CPU."""
        if self.config.lead_cpu is None or service == "worker":
            return None
        from services.worker.lead_cpu import other_cpus
        return other_cpus(self.config.lead_cpu)

    async def start(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        for p in self.plan:
            for _, names in p.peers:
                for peer in names:
                    await self.race(self.children[peer].listening.wait(), deadline - time.monotonic(),
                                    f"{peer} listening")
            child = Child(p.name, self._argv(p.service, p.peers, p.name), sys.stderr, service=p.service,
                          cpus=self._cpus(p.service))
            await self._spawn(child)
            log.info("started", extra={"child": p.name, "pid": child.pid})
        for name, child in self.children.items():
            await self.race(child.listening.wait(), deadline - time.monotonic(), f"{name} listening")
        for name, child in self.children.items():
            await self.race(_serving(child.address), deadline - time.monotonic(), f"{name} SERVING")

    async def _spawn(self, child: Child) -> None:
        await child.spawn()
        self.children[child.name] = child
        self.exits[child.name] = asyncio.create_task(child.wait())
        self.started_at[child.name] = time.monotonic()

    async def supervise(self) -> None:
        """Until a stop is asked for (Interrupted). A dead child raises ChildDied, unless
        --restart-on-failure restarts it."""
        while True:
            try:
                await self.race(asyncio.Event().wait(), None, "the end")
            except ChildDied as e:
                if not self.config.restart_on_failure:
                    raise
                await self.restart(e.child)

    async def restart(self, dead: Child) -> None:
        """Start `dead` again on its address, with backoff; raises ChildDied when its tries are
        spent. Only the restarted child is watched meanwhile (another death is seen after)."""
        name, cfg = dead.name, self.config
        while True:
            self.exits.pop(name, None)
            dead.kill_group()  # anything it left in its process group
            if time.monotonic() - self.started_at[name] >= RESTART_RESET_S:
                self.tries[name] = 0
            tries = self.tries.get(name, 0)
            if tries >= cfg.restart_max_tries:
                log.error("giving up restarting", extra={"child": name, "tries": tries})
                raise ChildDied(dead)
            self.tries[name] = tries + 1
            delay = min(RESTART_BACKOFF_CAP_S, cfg.restart_backoff_s * 2 ** tries)
            log.warning("child died: restarting", extra={
                "child": name, "status": dead.describe_exit(), "try": tries + 1, "of": cfg.restart_max_tries,
                "delay_s": delay, "last_lines": list(dead.tail)[-10:]})
            print(f"radixmesh up: {name} died ({dead.describe_exit()}); restarting it in {delay:g}s "
                  f"(try {tries + 1} of {cfg.restart_max_tries})", file=sys.stderr, flush=True)
            await self.race(asyncio.sleep(delay), None, "restart backoff", watch=[])
            child = Child(name, _pinned(dead), sys.stderr, service=dead.service, cpus=dead.cpus)
            await self._spawn(child)
            try:
                await self.race(child.listening.wait(), cfg.start_timeout_s, f"{name} listening", watch=[name])
                await self.race(_serving(child.address), cfg.start_timeout_s, f"{name} SERVING", watch=[name])
            except (ChildDied, TimeoutError) as e:
                log.error("restart failed", extra={"child": name, "error": str(e) or "it died"})
                child.kill_group()
                await child.wait()
                dead = child
                continue
            log.info("restarted", extra={"child": name, "pid": child.pid, "address": child.address})
            print(f"radixmesh up: {name} restarted (pid {child.pid}, {child.address})", file=sys.stderr, flush=True)
            return

    async def shutdown(self) -> int:
        """Stop front to back; returns 0 when every child exited 0."""
        for group in FLEET_STOP_ORDER:
            members = [c for c in self.children.values() if c.service in group]
            for child in members:
                child.signal(signal.SIGTERM)
            waits = [self.exits[c.name] for c in members if c.running]
            if waits:
                hurry = asyncio.ensure_future(self.hurry.wait())
                grace = self.config.drain_timeout_s + self.config.kill_grace_s
                await asyncio.wait({asyncio.ensure_future(asyncio.wait(waits, timeout=grace)), hurry},
                                   return_when=asyncio.FIRST_COMPLETED)
                if hurry.done():
                    await asyncio.wait(waits, timeout=self.config.kill_grace_s)
                hurry.cancel()
            for child in members:
                if child.running:
                    log.warning("child did not stop in time: SIGKILL", extra={"child": child.name})
                child.kill_group()  # also reaps anything it left in its group
                await child.wait()
        codes = {name: c.proc.returncode for name, c in self.children.items()}
        log.info("stopped", extra={"exit_codes": codes})
        return 0 if all(code == 0 for code in codes.values()) else 1


def _pinned(child: Child) -> list[str]:
    """The child's flags with the ports it bound pinned (gRPC, and the gateway's HTTP port), so
    that a restart comes back where its peers and clients look for it."""
    argv = list(child.argv)
    pins = {"--listen": child.address if child.port is not None else None,
            "--http-port": child.listen_event.get("http_port")}
    for flag, value in pins.items():
        if value is not None and flag in argv:
            argv[argv.index(flag) + 1] = str(value)
    return argv


async def _serving(address: str) -> None:
    async with tls.aio_channel(address) as channel:  # the TLS flags forwarded to the services
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)


async def run(config: UpConfig, routed: dict[str, list[str]], dp: int = 1) -> int:
    mesh = Mesh(config, routed, dp)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, mesh.on_signal)
    try:
        await mesh.start()
        addresses = {name: c.address for name, c in mesh.children.items()}
        gateway = mesh.children.get("gateway")
        url = (gateway.listen_event.get("url") or f"http://127.0.0.1:{config.http_port}") if gateway else None
        log.info("ready", extra={"url": url, "addresses": addresses,
                                 "pids": {name: c.pid for name, c in mesh.children.items()}})
        front = "router" if "router" in addresses else "tokenizer"
        print(f"radixmesh is up: {url or 'no gateway'}; {front} gRPC at {addresses[front]} "
              "(Ctrl-C to stop)", flush=True)
        if config.metrics_port is not None:
            ports = {name: c.listen_event.get("metrics_port") for name, c in mesh.children.items()
                     if name in mesh.metrics_ports}
            log.info("metrics", extra={"metrics_ports": ports})
            print("metrics: " + ", ".join(f"{name} http://127.0.0.1:{port}/metrics" for name, port in ports.items())
                  + (f", gateway {url}/metrics" if url else ""), flush=True)
        await mesh.supervise()
    except Interrupted:
        log.info("stopping", extra={"reason": "signal"})
        return await mesh.shutdown()
    except ChildDied as e:
        child = e.child
        log.error("child died", extra={"child": child.name, "status": child.describe_exit(),
                                       "last_lines": list(child.tail)[-10:]})
        print(f"radixmesh up: {child.name} died ({child.describe_exit()}); stopping the others. "
              f"Its last log lines:\n{child.last_lines()}", file=sys.stderr, flush=True)
        await mesh.shutdown()
        return 1
    except TimeoutError as e:
        log.error("start timed out", extra={"error": str(e)})
        await mesh.shutdown()
        return 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    flags_from_dataclass(UpConfig, parser)
    args, extra = parser.parse_known_args(argv)
    try:
        config = config_from_args(UpConfig, args)
        services = [name for name, _ in TOPOLOGY if name != "gateway" or config.gateway]
        dp = dp_lanes(extra)
        if config.starts_router or dp > 1:
            services.append("router")
        if config.use_kvstore:
            services.append("kvstore")
        if config.disaggregated:
            pd.refuse_owned(extra)
        routed = route_flags(extra, services)
        metrics_ports(plan(config.replicas, config.router, config.gateway, config.use_kvstore, config.prefill,
                           config.decode, dp), config.metrics_port)
    except ValueError as e:
        parser.error(str(e))
    if config.gateway and load_ref("services.gateway.main:main") is None:
        parser.error("the gateway (services/gateway/main.py) is not available here: use --no-gateway")
    setup_logging("launcher", "info")
    tls.configure_clients(tls.client_from_argv(extra))  # probe the children as they dial each other
    return asyncio.run(run(config, routed, dp))
