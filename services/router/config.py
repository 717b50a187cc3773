"""The router's flags, generated from this dataclass (services/common/config.py).

Two ways to give the fleet: co-located replicas (`--replica-addrs`, `--replica-dns`), each
serving a request whole, or a disaggregated one (`--prefill` / `--prefill-dns` and `--decode` /
`--decode-dns`), in which every request runs on a pair: a prefill replica chosen by
`--prefill-policy` and a decode replica chosen by `--decode-policy` (services/router/pairing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import CommonConfig
from services.router.policies import POLICIES

DEFAULT_LISTEN = "127.0.0.1:50055"


@dataclass(frozen=True)
class RouterConfig:
    """Routing, health and retry knobs. Thresholds follow the cache_aware policy's docstring."""
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    replica_addrs: list[str] = field(default_factory=list, metadata={
        "help": "the replicas' front doors (their tokenizers' HOST:PORT); more can be added at run time "
                "through the Router admin RPC"})
    policy: str = field(default="cache_aware", metadata={"help": "routing policy", "choices": tuple(POLICIES)})
    prefill: list[str] = field(default_factory=list, metadata={
        "help": "a disaggregated fleet: the prefill replicas' front doors (tokenizers' HOST:PORT, started with "
                "--disaggregation-mode prefill); needs --decode (or --decode-dns); replaces --replica-addrs"})
    decode: list[str] = field(default_factory=list, metadata={
        "help": "a disaggregated fleet: the decode replicas' front doors (--disaggregation-mode decode)"})
    prefill_dns: str | None = field(default=None, metadata={
        "help": "NAME:PORT: the prefill replicas are NAME's DNS addresses (as --replica-dns)"})
    decode_dns: str | None = field(default=None, metadata={
        "help": "NAME:PORT: the decode replicas are NAME's DNS addresses (as --replica-dns)"})
    prefill_policy: str = field(default="cache_aware", metadata={
        "help": "a disaggregated fleet: how the prefill replica of a pair is chosen (its prefix cache matters "
                "there)", "choices": tuple(POLICIES)})
    decode_policy: str = field(default="least_load", metadata={
        "help": "a disaggregated fleet: how the decode replica of a pair is chosen", "choices": tuple(POLICIES)})
    cache_threshold: float = field(default=0.5, metadata={
        "help": "cache_aware: follow the longest prefix match when it covers more than this share of the request"})
    balance_abs_threshold: int = field(default=16, metadata={
        "help": "cache_aware: the fleet is imbalanced when max load - min load exceeds this ..."})
    balance_rel_threshold: float = field(default=1.5, metadata={
        "help": "... and max load exceeds this times min load; then requests go to the least loaded replica"})
    max_tree_chars: int = field(default=1 << 22, metadata={
        "help": "cache_aware: characters of routing history kept per replica (LRU leaves evicted beyond)"})
    eviction_interval_s: float = field(default=10.0, metadata={"help": "seconds between tree evictions"})
    health_interval_s: float = field(default=1.0, metadata={"help": "seconds between grpc.health checks"})
    health_timeout_s: float = field(default=1.0, metadata={"help": "a health check slower than this failed"})
    unhealthy_threshold: int = field(default=2, metadata={
        "help": "consecutive failed health checks that eject a replica"})
    healthy_threshold: int = field(default=1, metadata={"help": "consecutive passed checks that re-admit it"})
    load_interval_s: float = field(default=0.5, metadata={"help": "seconds between GetLoad polls"})
    max_retries: int = field(default=2, metadata={
        "help": "retries of a request that failed before its first token (each on another replica if any)"})
    retry_backoff_s: float = field(default=0.05, metadata={
        "help": "first retry's backoff; doubles per retry, with +-50% jitter"})
    retry_backoff_max_s: float = field(default=1.0, metadata={"help": "cap on one backoff"})
    breaker_failures: int = field(default=3, metadata={
        "help": "consecutive failed attempts that open a replica's circuit breaker"})
    breaker_cooldown_s: float = field(default=5.0, metadata={
        "help": "an open breaker lets one trial request through after this long"})
    drain_wait_s: float = field(default=60.0, metadata={
        "help": "RemoveReplica without force: the most it waits for the replica's in-flight requests"})
    replica_dns: str | None = field(default=None, metadata={
        "help": "NAME:PORT: discover replicas as NAME's DNS addresses (A records; AAAA when it has none), e.g. a "
                "Kubernetes headless Service; re-resolved every --replica-dns-interval-s, an address that appears "
                "is added, one that vanishes is drained and removed (services/router/discovery.py); none = off"})
    replica_dns_interval_s: float = field(default=5.0, metadata={"help": "seconds between --replica-dns lookups"})
    peer_wait_s: float = field(default=600.0, metadata={
        "help": "at start: seconds to wait for every --replica-addrs entry to be SERVING; then the router serves "
                "if at least one is"})
    seed: int | None = field(default=None, metadata={"help": "seed of the random policies and jitter"})

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        for name in ("eviction_interval_s", "health_interval_s", "health_timeout_s", "load_interval_s",
                     "peer_wait_s", "replica_dns_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_tree_chars < 1 or self.unhealthy_threshold < 1 or self.healthy_threshold < 1 \
                or self.breaker_failures < 1:
            raise ValueError("--max-tree-chars, --unhealthy-threshold, --healthy-threshold and "
                             "--breaker-failures must be >= 1")
        if self.max_retries < 0 or self.retry_backoff_s < 0 or self.retry_backoff_max_s < 0 \
                or self.breaker_cooldown_s < 0 or self.drain_wait_s < 0:
            raise ValueError("--max-retries and the backoff, cooldown and drain times must be >= 0")
        for addr in self.replica_addrs:
            if not _is_host_port(addr):
                raise ValueError(f"--replica-addrs takes HOST:PORT entries, got {addr!r}")
        for flag in ("replica_dns", "prefill_dns", "decode_dns"):
            if getattr(self, flag) is not None and not _is_host_port(getattr(self, flag)):
                raise ValueError(f"--{flag.replace('_', '-')} takes NAME:PORT, got {getattr(self, flag)!r}")
        self._check_pools()

    @property
    def disaggregated(self) -> bool:
        """Requests run on prefill/decode pairs (services/router/pairing.py)."""
        return bool(self.prefill or self.decode or self.prefill_dns or self.decode_dns)

    def _check_pools(self) -> None:
        for flag in ("prefill", "decode"):
            for addr in getattr(self, flag):
                if not _is_host_port(addr):
                    raise ValueError(f"--{flag} takes HOST:PORT entries, got {addr!r}")
        if not self.disaggregated:
            return
        if self.replica_addrs or self.replica_dns:
            raise ValueError("--prefill/--decode (a disaggregated fleet) and --replica-addrs/--replica-dns "
                             "(co-located replicas) exclude each other: give one or the other")
        missing = [flag for flag in ("prefill", "decode")
                   if not getattr(self, flag) and getattr(self, f"{flag}_dns") is None]
        if missing:
            raise ValueError(f"a disaggregated fleet needs both pools: give --{missing[0]} ADDR ... "
                             f"(or --{missing[0]}-dns NAME:PORT) as well")


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)
