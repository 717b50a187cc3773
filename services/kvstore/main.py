"""`radixmesh serve kvstore`: KV-cache pages in a memory LRU spilling to a disk directory."""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.hicache_config import AUTH_TOKEN_ENV
from services.common.secret_file import token_from
from services.common.server import run_service
from services.kvstore.store import StoreConfig

DEFAULT_LISTEN = "127.0.0.1:50056"
ADMIN_TOKEN_ENV = "RADIXMESH_KVSTORE_ADMIN_TOKEN"


@dataclass(frozen=True)
class KVStoreConfig:
    # Flags carry a kvstore- prefix: `radixmesh up` forwards flags by name to every service.
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    kvstore_memory_bytes: int = field(default=1 << 30, metadata={
        "help": "payload bytes the memory tier holds; least recently used pages spill to disk"})
    kvstore_disk_dir: str | None = field(default=None, metadata={
        "help": "directory of the disk tier (kept across restarts); none = memory only, evictions dropped"})
    kvstore_disk_bytes: int = field(default=8 << 30, metadata={
        "help": "file bytes the disk tier holds; least recently used pages are deleted"})
    # The same flag as the clients' (HiCacheConfig): `radixmesh up --kvstore-auth-token-file F` sets both ends.
    kvstore_auth_token_file: str | None = field(default=None, metadata={
        "help": "require this file's fleet token (authorization: Bearer) on every page call "
                f"(else ${AUTH_TOKEN_ENV}); none = anyone who can connect may call"})
    kvstore_admin_token_file: str | None = field(default=None, metadata={
        "help": "the token Clear requires (it empties every replica's pages; also accepted for page calls; "
                f"else ${ADMIN_TOKEN_ENV}); none with a fleet token = Clear is refused"})

    kvstore_claim_ttl_s: float = field(default=10.0, metadata={
        "help": "how long a replica's claim on pages it is computing holds (another replica's Exists "
                "waits for them, see docs/kvstore.md) when they do not land"})

    def __post_init__(self) -> None:
        if self.kvstore_claim_ttl_s <= 0:
            raise ValueError(f"--kvstore-claim-ttl-s must be > 0, got {self.kvstore_claim_ttl_s}")
        if self.kvstore_memory_bytes < 0:
            raise ValueError(f"--kvstore-memory-bytes must be >= 0, got {self.kvstore_memory_bytes}")
        if self.kvstore_disk_bytes < 0:
            raise ValueError(f"--kvstore-disk-bytes must be >= 0, got {self.kvstore_disk_bytes}")
        self.tokens()  # unreadable or too short: a usage error

    def tokens(self) -> tuple[str | None, str | None]:
        """(fleet token, admin token), each None when not configured."""
        return (token_from(self.kvstore_auth_token_file, AUTH_TOKEN_ENV, "--kvstore-auth-token-file"),
                token_from(self.kvstore_admin_token_file, ADMIN_TOKEN_ENV, "--kvstore-admin-token-file"))

    @property
    def store(self) -> StoreConfig:
        return StoreConfig(memory_bytes=self.kvstore_memory_bytes, disk_dir=self.kvstore_disk_dir,
                           disk_bytes=self.kvstore_disk_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve kvstore", description=__doc__)
    config = parse_config(KVStoreConfig, argv, parser)
    from services.kvstore.auth import TokenAuth
    from services.kvstore.claims import Claims
    from services.kvstore.metrics import make_registry
    from services.kvstore.service import KVStoreService
    from services.kvstore.store import KVStore

    service = KVStoreService(None, Claims(config.kvstore_claim_ttl_s))  # type: ignore[arg-type]  # store: on_start

    async def on_start() -> None:
        service.store = await asyncio.to_thread(KVStore, config.store)  # scans the disk directory

    def add_servicers(server: grpc.aio.Server) -> None:
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server)

    fleet, admin = config.tokens()
    return run_service("kvstore", config.common, add_servicers, on_start=on_start,
                       registry=make_registry(lambda: service.store, service.claims),
                       interceptors=[TokenAuth(fleet, admin)] if fleet or admin else [])
