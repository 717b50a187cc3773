"""A model-free replica for router tests: the Tokenizer surface with a simulated prefix cache.

    python -m tests.doubles.fake_replica --listen 127.0.0.1:0 --name a [--fail always]

Generate streams `max_new_tokens` (default 8) one-token chunks, `--token-delay-s` apart, after
a prefill delay of `--prefill-s` × the share of the prompt not found in its cache. The cache
remembers prompts (the router's routing key) in `--block-chars` blocks, so a request hits as
many leading blocks as some earlier request shared with it; GetLoad reports the hit rate like a
real scheduler. At most `--capacity` requests run at once; the rest wait (num_waiting). The
first chunk's text is the replica's --name, so a client can tell who served it. With `--fail
always` every Generate fails with UNAVAILABLE while health stays SERVING (a broken replica
that health checks cannot see).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc
from services.common.config import CommonConfig, parse_config
from services.common.server import run_service
from services.router.service import routing_key
from tests.doubles.v2_generate import add_both


@dataclass(frozen=True)
class FakeReplicaConfig:
    common: CommonConfig = field(default_factory=CommonConfig)
    name: str = field(default="fake", metadata={"help": "sent as the first chunk's text"})
    token_delay_s: float = field(default=0.01, metadata={"help": "seconds between tokens"})
    prefill_s: float = field(default=0.05, metadata={"help": "prefill time of a prompt with nothing cached"})
    capacity: int = field(default=64, metadata={"help": "requests running at once; more wait"})
    block_chars: int = field(default=32, metadata={"help": "cache granularity, in characters of the routing key"})
    fail: str = field(default="never", metadata={"help": "never | always", "choices": ("never", "always")})


class FakeReplica(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, config: FakeReplicaConfig) -> None:
        self.config = config
        self.blocks: set[bytes] = set()
        self.hit = self.query = 0
        self.running = self.waiting = self.in_flight = 0
        self._slots: asyncio.Semaphore | None = None

    def _lookup_and_insert(self, key: str) -> int:
        """Leading characters of key found in the cache; then the whole key is cached."""
        size, chain, hit, missed = self.config.block_chars, hashlib.blake2b(digest_size=16), 0, False
        for start in range(0, len(key), size):
            chain.update(key[start:start + size].encode("utf-8", "surrogatepass"))
            digest = chain.copy().digest()
            if not missed and digest in self.blocks:
                hit = min(len(key), start + size)
            else:
                missed = True
                self.blocks.add(digest)
        return hit

    async def Generate(self, request: pb.GenerateTextRequest, context: grpc.aio.ServicerContext):
        if self.config.fail == "always":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.config.name} always fails")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.capacity)
        key = routing_key(request)
        tokens = request.sampling.max_new_tokens if request.sampling.HasField("max_new_tokens") else 8
        self.in_flight += 1
        self.waiting += 1
        try:
            async with self._slots:
                self.waiting -= 1
                self.running += 1
                try:
                    hit = self._lookup_and_insert(key)
                    self.hit, self.query = self.hit + hit, self.query + len(key)
                    await asyncio.sleep(self.config.prefill_s * (1 - hit / max(1, len(key))))
                    for i in range(tokens):
                        if i:
                            await asyncio.sleep(self.config.token_delay_s)
                        yield cpb.GenerateResponse(chunk=cpb.GenerateChunk(
                            index=0, token_ids=[i], text=self.config.name if i == 0 else ".",
                            prompt_tokens=len(key), completion_tokens=i + 1, cached_tokens=hit))
                    yield cpb.GenerateResponse(finish=cpb.Finish(index=0, finish_reason=cpb.FINISH_REASON_LENGTH))
                finally:
                    self.running -= 1
        finally:
            self.in_flight -= 1

    async def GetLoad(self, request, context) -> pb.LoadReport:
        return pb.LoadReport(num_running=self.running, num_waiting=self.waiting, in_flight=self.in_flight,
                             kv_usage=0.0, cache_hit_tokens=self.hit, cache_query_tokens=self.query,
                             cache_hit_rate=self.hit / self.query if self.query else 0.0)

    async def Info(self, request, context) -> pb.InfoResponse:
        return pb.InfoResponse(model_name="fake", vocab_size=256, context_length=1 << 16, has_chat_template=True)

    async def Ready(self, request, context) -> pb.ReadyResponse:
        return pb.ReadyResponse(ready=True)

    async def Tokenize(self, request, context) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(items=[pb.TokenIds(ids=list(t.encode())) for t in request.texts.texts])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_replica", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    config = parse_config(FakeReplicaConfig, argv, parser)
    replica = FakeReplica(config)
    return run_service(f"fake-replica-{config.name}", config.common,
                       lambda server: add_both(replica, server))


if __name__ == "__main__":
    import sys

    sys.exit(main())
