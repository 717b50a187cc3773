"""Two replicas' scheduler cores sharing a real kvstore over loopback gRPC (issue 33).

Replica A computes a prompt whose write-through is still in flight when the same prompt
reaches replica B (held here until the test releases it: on the mesh it is a step and a
~20 MB transfer behind A's answer). B's probe must not block B's loop: another request
runs to its end on B meanwhile; and it must not answer the miss the store holds at that
moment: the store holds it back while A's claim stands, and B then loads all of A's pages.

The workers are the token-id fake worker (tests/doubles/fake_worker.py) with a host pool;
their STORE tier is the real store, each page its token ids as a float32 tensor, through
the replica's own BlockingKVStore, as a real worker's is (so a page from the wrong place
shows up as a wrong token).
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import torch

from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.common.hicache_config import HiCacheConfig
from services.common.sampling_params import SamplingParams
from services.kvstore.blocking import BlockingKVStore
from services.kvstore.claims import Claims
from services.kvstore.page_codec import PageSpec
from services.kvstore.service import KVStoreService
from services.kvstore.store import KVStore, StoreConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.scheduler import ModelLimits, Scheduler
from services.step.contract import DEVICE, HOST, STORE, KVCopy, KVTransferStat, StepPlan, StepResult
from tests.doubles.fake_link import FakeLink
from tests.doubles.fake_worker import VOCAB, FakeWorker, reference_output

PS = 4
SPEC = PageSpec(num_layers=1, page_size=PS, num_kv_heads=1, head_dim=1, dtype=torch.float32)
EOS = 0
GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


class StoreBackedWorker:
    """FakeWorker plus a host pool; STORE copies go to the real kvstore through `store`.
    With hold_writes, DEVICE -> STORE writes wait in `held` until release_writes()."""

    def __init__(self, store: BlockingKVStore, num_pages: int = 32, host_pages: int = 32,
                 hold_writes: bool = False) -> None:
        self.inner = FakeWorker(num_pages, PS)
        self.pools = {DEVICE: self.inner.slots, HOST: [-1] * (host_pages * PS)}
        self.store, self.hold_writes = store, hold_writes
        self.held: list[tuple[list[bytes], torch.Tensor]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        stats = [KVTransferStat(n, n * SPEC.nbytes, 1e-6) for n in map(self._copy, plan.kv_copies)]
        result = self.inner.execute(plan)
        result.kv_transfers = stats
        return result

    def _copy(self, op: KVCopy) -> int:
        if op.dst_tier == STORE:
            pages = torch.zeros((len(op.src_pages), *SPEC.shape))
            for i, p in enumerate(op.src_pages):
                pages[i, 0, 0, :, 0, 0] = torch.tensor(self.pools[op.src_tier][p * PS:(p + 1) * PS])
            self.held.append((list(op.keys), pages))
            if not self.hold_writes:
                self.release_writes()
            return len(op.src_pages)
        if op.src_tier == STORE:
            data = self.store.get_prefix(op.keys[:len(op.dst_pages)])
            for i, p in enumerate(op.dst_pages[:data.shape[0]]):
                self.pools[op.dst_tier][p * PS:(p + 1) * PS] = data[i, 0, 0, :, 0, 0].long().tolist()
            return int(data.shape[0])
        for s, d in zip(op.src_pages, op.dst_pages, strict=True):
            self.pools[op.dst_tier][d * PS:(d + 1) * PS] = self.pools[op.src_tier][s * PS:(s + 1) * PS]
        return len(op.src_pages)

    def release_writes(self) -> None:
        """The writes in flight land (fire-and-forget, then waited for)."""
        for keys, pages in self.held:
            assert self.store.put_nowait(keys, pages)
        self.held = []
        self.store.flush(timeout=60)


def replica(address: str, hold_writes: bool = False) -> tuple[Scheduler, StoreBackedWorker, list[BlockingKVStore]]:
    """A scheduler core and its worker, each with its own client of the store (as on the mesh)."""
    probe, worker_store = BlockingKVStore(address, SPEC), BlockingKVStore(address, SPEC)
    limits = ModelLimits(32, PS, 256, VOCAB, (EOS,), host_pages=32, page_bytes=SPEC.nbytes, model_identity="m",
                         weights_version="0", kv_layout=SPEC.layout)
    hc = HiCacheConfig(hicache_prefetch_threshold=PS, hicache_load_policy="always")
    sched = Scheduler(SchedulerConfig(max_running_requests=4), limits, hc, probe)
    return sched, StoreBackedWorker(worker_store, hold_writes=hold_writes), [probe, worker_store]


def run(sched: Scheduler, worker: StoreBackedWorker, finished: dict[str, threading.Event] | None = None) -> dict:
    """Drive `sched` until idle (the StepDriver, as the service does); rid -> [tokens, reason, cached].
    finished: events set as those requests end."""
    results: dict = {}

    def deliver(outs) -> None:
        for o in outs:
            entry = results.setdefault(o.rid, [[], None, 0])
            entry[0].extend(o.token_ids)
            if o.finished:
                entry[1], entry[2] = o.finish_reason, o.cached_tokens
                if finished and o.rid in finished:
                    finished[o.rid].set()

    async def recover(exc, reason):
        raise exc

    hooks = DriverHooks(recover, between_steps=lambda core: core.check_invariants(), deliver=deliver)
    asyncio.run(StepDriver(hooks, sched, FakeLink(worker), depth=1).run())
    return results


async def start_store() -> tuple[grpc.aio.Server, KVStoreService, str]:
    service = KVStoreService(KVStore(StoreConfig(memory_bytes=1 << 20)), Claims(ttl_s=600))
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, service, f"127.0.0.1:{port}"


async def test_replica_b_waits_for_the_pages_replica_a_is_still_writing_and_serves_others_meanwhile():
    server, service, address = await start_store()
    a, a_worker, a_clients = replica(address, hold_writes=True)
    b, b_worker, b_clients = replica(address)
    b.hicache.estimates.prefill_tokens_per_s = 1.0  # recomputing is slow: waiting for A's pages pays
    b.hicache.max_store_wait_s = 120.0  # and a loaded test machine never ends the wait first
    prompt, other = [(7 * i) % (VOCAB - 1) + 1 for i in range(24)], [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        a.submit("a", prompt, GREEDY, seed=0)
        res_a = await asyncio.to_thread(run, a, a_worker)
        assert res_a["a"][2] == 0 and a_worker.held  # computed; its write-through is in flight
        b.submit("b", prompt + [5], GREEDY, seed=0)
        b.submit("c", other, GREEDY, seed=0)
        c_done = threading.Event()
        b_run = asyncio.ensure_future(asyncio.to_thread(run, b, b_worker, {"c": c_done}))
        await asyncio.wait_for(service.claims.until_waits(1), 60)  # b's Exists waits on A's claim
        assert await asyncio.to_thread(c_done.wait, 60)  # c ran to its end on B meanwhile
        await asyncio.to_thread(a_worker.release_writes)  # A's pages land
        res_b = await asyncio.wait_for(b_run, 120)
        assert res_b["b"][2] == len(prompt) and b.stats.store_hit_tokens == len(prompt)
        assert res_b["b"][0] == reference_output(prompt + [5], 4, (EOS,))
        assert res_b["c"][0] == reference_output(other, 4, (EOS,))
        assert service.claims.waits >= 1
    finally:
        for client in a_clients + b_clients:
            await asyncio.to_thread(client.close)
        await server.stop(None)
