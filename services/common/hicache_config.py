"""The hierarchical KV cache's configuration, read by both ends of the step contract:
the worker sizes its host pool and reaches the kvstore from it, the scheduler takes its
tier policies from it (docs/kvstore.md, "The hierarchical cache")."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.secret_file import secret_from, token_from

WRITE_POLICIES = ("write_through", "write_back")
LOAD_POLICIES = ("auto", "always", "never")
KEY_SECRET_ENV = "RADIXMESH_KV_KEY_SECRET"            # the secret itself, when --kv-key-secret-file is unset
AUTH_TOKEN_ENV = "RADIXMESH_KVSTORE_AUTH_TOKEN"        # the fleet token, when --kvstore-auth-token-file is unset


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
    kv_key_secret_file: str | None = field(default=None, metadata={
        "help": "page keys become HMAC-SHA256 with the secret in this file (the same on every scheduler "
                f"sharing a store; else ${KEY_SECRET_ENV}); none and no variable = unkeyed keys"})
    kvstore_auth_token_file: str | None = field(default=None, metadata={
        "help": "the fleet token this service sends the kvstore (authorization: Bearer); the store's flag of "
                f"the same name requires it (else ${AUTH_TOKEN_ENV}); none = no token"})

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
        self.key_secret()  # unreadable or too short: a usage error now, not a failure at the first request
        self.kvstore_auth_token()

    def key_secret(self) -> bytes | None:
        """The page-key secret (read from its file or the environment), None = unkeyed."""
        return secret_from(self.kv_key_secret_file, KEY_SECRET_ENV, "--kv-key-secret-file")

    def kvstore_auth_token(self) -> str | None:
        """The token kvstore clients send, None = none."""
        return token_from(self.kvstore_auth_token_file, AUTH_TOKEN_ENV, "--kvstore-auth-token-file")

    @property
    def host_ratio(self) -> float:
        """The host tier's size in device pools (a store needs the host tier to stage loads)."""
        return max(self.host_kv_ratio, 1.0) if self.kvstore_addr else self.host_kv_ratio

    def host_pages(self, device_pages: int) -> int:
        return int(device_pages * self.host_ratio)
