"""The scheduler's configuration."""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("fcfs", "lpm")
WRITE_POLICIES = ("write_through", "write_back")
LOAD_POLICIES = ("auto", "always", "never")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = field(default=64, metadata={"help": "requests decoding at once"})
    max_prefill_tokens: int = field(default=4096, metadata={"help": "prefill tokens admitted per step"})
    chunked_prefill_size: int = field(default=1024, metadata={
        "help": "prefill chunk per step; -1 disables chunking. Larger chunks run prefill at a higher GEMM "
                "efficiency but stall running decodes longer (a 1,024-token step takes ~0.4 s on 2 cores; "
                "docs/benchmarks.md)"})
    schedule_policy: str = field(default="lpm", metadata={"help": "waiting-queue order: fcfs | lpm (longest prefix match)"})
    lpm_fallback_queue_len: int = field(default=128, metadata={"help": "lpm falls back to fcfs above this queue length"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn the prefix cache off"})
    max_queued_requests: int = field(default=1024, metadata={"help": "waiting requests before new ones are refused"})
    max_queued_tokens: int = field(default=1 << 20, metadata={"help": "waiting prompt tokens before new requests are refused"})
    init_new_token_ratio: float = field(default=0.7, metadata={"help": "share of max_new_tokens reserved per running request"})
    min_new_token_ratio: float = field(default=0.15, metadata={"help": "floor the reservation decays to"})
    new_token_ratio_decay: float = field(default=0.002, metadata={"help": "per-step decay of the reservation ratio"})
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "plan each step only after the last one's result is back; by default the scheduler "
                "service plans step n+1 while the worker runs step n (the in-process Engine always "
                "runs one step at a time)"})

    def __post_init__(self) -> None:
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"--schedule-policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be positive or -1 (off)")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")

    @property
    def prefill_budget(self) -> int:
        if self.chunked_prefill_size > 0:
            return min(self.max_prefill_tokens, self.chunked_prefill_size)
        return self.max_prefill_tokens


@dataclass(frozen=True)
class HiCacheConfig:
    """The hierarchical KV cache: a host tier below the worker's pool and a
    kvstore below that. The worker sizes its host pool from these flags; the
    scheduler decides every move (docs/kvstore.md, "The hierarchical cache")."""
    host_kv_ratio: float = field(default=0.0, metadata={
        "help": "host KV tier size as a multiple of the device pool; 0 = off "
                "(with --kvstore-addr at least 1: store loads are staged there)"})
    kvstore_addr: str | None = field(default=None, metadata={
        "help": "a radixmesh kvstore shared by replicas (host:port); none = no store tier"})
    hicache_write_policy: str = field(default="write_through", metadata={
        "help": "write_through: every newly computed full page goes to the store; "
                "write_back: pages go there only when evicted from the lowest worker tier"})
    hicache_prefetch_threshold: int = field(default=64, metadata={
        "help": "prefetch from the store while a request waits only when the store holds at least "
                "this many more tokens of its prefix than the worker's tiers"})
    hicache_load_policy: str = field(default="auto", metadata={
        "help": "auto: load a prefix from a lower tier only when its measured transfer time beats "
                "the measured prefill time for those tokens; always; never (recompute)"})
    kvstore_timeout_s: float = field(default=2.0, metadata={"help": "kvstore call deadline (plus size-based time)"})

    def __post_init__(self) -> None:
        if self.host_kv_ratio < 0:
            raise ValueError(f"--host-kv-ratio must be >= 0, got {self.host_kv_ratio}")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {WRITE_POLICIES}, "
                             f"got {self.hicache_write_policy!r}")
        if self.hicache_load_policy not in LOAD_POLICIES:
            raise ValueError(f"--hicache-load-policy must be one of {LOAD_POLICIES}, "
                             f"got {self.hicache_load_policy!r}")
        if self.hicache_prefetch_threshold < 0:
            raise ValueError("--hicache-prefetch-threshold must be >= 0 tokens")
        if self.kvstore_timeout_s <= 0:
            raise ValueError("--kvstore-timeout-s must be > 0")

    @property
    def host_ratio(self) -> float:
        """The host tier's size in device pools (a store needs the host tier to stage loads)."""
        return max(self.host_kv_ratio, 1.0) if self.kvstore_addr else self.host_kv_ratio

    def host_pages(self, device_pages: int) -> int:
        return int(device_pages * self.host_ratio)
