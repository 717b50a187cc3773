"""An MLA latent KV pool (DeepSeek-V3: one row of kv_lora_rank + rope dims per token, no V) end to
end: the in-process Engine on the random tiny DeepSeek-V3 (tests/unit/tiny_models.py) gives
transformers' greedy tokens for a prompt whose prefix came back from the host tier or from a
real kvstore; the PD transfer engines move a latent pool's k bytes, once, into a latent receiver
and refuse an ordinary one; and a prefill and a decode replica (`radixmesh up`, shm backend, ~35 s)
give transformers' greedy tokens.

Small on purpose (2 shared cores): float32, a KV pool of 160 tokens, prompts of ~50 tokens.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import uuid

import numpy as np
import pytest
import torch

from protos.radixmesh.v1 import tokenizer_pb2
from services.common.hicache_config import HiCacheConfig
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.kv_transfer import KVTransferError, create_engine, pool_storage
from services.worker.kv_transfer.mooncake_engine import _engine_class
from tests.integration.mesh_harness import Mesh, greedy
from tests.integration.test_disaggregation_mesh import run_pair, settle
from tests.integration.test_hicache_engine import StoreServer
from tests.unit.tiny_models import DEEPSEEK, greedy_continuation, save_for_generation

N_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=N_NEW, ignore_eos=True)
L, LATENT, ROPE = DEEPSEEK["num_hidden_layers"], DEEPSEEK["kv_lora_rank"], DEEPSEEK["qk_rope_head_dim"]
D = LATENT + ROPE
TOKEN_BYTES = L * D * 4  # one float32 latent row a layer: no V


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_for_generation(tmp_path_factory.mktemp("deepseek"), "deepseek_v3")


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(path: str, kv_tokens: int = 160, **hicache) -> Engine:
    hc = HiCacheConfig(**{"hicache_prefetch_threshold": 8, "hicache_load_policy": "always", **hicache})
    worker = WorkerConfig(model=path, dtype="float32", page_size=4, kv_cache_bytes=kv_tokens * TOKEN_BYTES,
                          max_requests=4)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=4), hicache=hc)


def gen(eng: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(prompt, GREEDY, q.put)
    tokens = []
    while True:
        chunk = q.get(timeout=120)
        assert chunk.error is None, chunk.error
        tokens += chunk.token_ids
        if chunk.finished:
            return tokens, chunk.cached_tokens


SHARED = ids(0, 48)  # 12 pages of 4: a prefix two prompts share
PROMPTS = [SHARED + ids(1, 5), SHARED + ids(2, 7)]
FILLERS = [ids(10 + i, 50) for i in range(3)]


def test_host_tier_reload_gives_transformers_tokens(tiny):
    path, hf = tiny
    eng = engine(path, host_kv_ratio=4.0)
    try:
        host = eng.runner.kv_transfer.pools["host"]
        assert host.spec.latent_dim == LATENT and host.tensors == (host.k,)  # a latent host pool: no V
        assert host.k.nbytes + host.v.nbytes == host.spec.num_slots * TOKEN_BYTES  # a row a token, once
        out, cached = gen(eng, PROMPTS[0])
        assert out == greedy_continuation(hf, PROMPTS[0], N_NEW) and cached == 0
        for filler in FILLERS:  # 150 tokens through a 160-token pool: the shared prefix is demoted
            gen(eng, filler)
        s = eng.scheduler.stats
        assert s.pages_demoted > 0 and s.bytes_device_to_host > 0
        out, cached = gen(eng, PROMPTS[1])  # its prefix comes back from the host tier
        assert out == greedy_continuation(hf, PROMPTS[1], N_NEW)
        assert cached >= 40 and s.host_hit_tokens >= 40 and s.bytes_host_to_device > 0
        eng.scheduler.check_invariants()
    finally:
        eng.shutdown()


def test_a_second_engine_reads_latent_pages_from_the_kvstore(tiny, tmp_path):
    path, hf = tiny
    server = StoreServer(tmp_path / "kv").start()
    try:
        a = engine(path, kvstore_addr=server.address)
        try:
            gen(a, PROMPTS[0])
            a.flush_kv_writes()
            assert a.scheduler.stats.pages_written_to_store > 0
        finally:
            a.shutdown()
        b = engine(path, kvstore_addr=server.address)
        try:
            out, cached = gen(b, PROMPTS[1])
            assert out == greedy_continuation(hf, PROMPTS[1], N_NEW)
            assert cached >= 40 and b.scheduler.stats.store_hit_tokens >= 40
        finally:
            b.shutdown()
        assert server.store.stats().hits_memory > 0
    finally:
        server.close()


# -- PD: a latent pool between two transfer engines ------------------------------------------

SRC = [1, 2, 3, 7, 9, 10, 30]
DST = [20, 21, 22, 0, 5, 6, 31]


def _mooncake_missing() -> str | None:
    try:
        _engine_class()
    except KVTransferError as e:
        return str(e)
    return None


MOONCAKE_MISSING = _mooncake_missing()
BACKENDS = ["shm", "grpc", pytest.param("mooncake", marks=pytest.mark.skipif(
    MOONCAKE_MISSING is not None, reason=f"mooncake unavailable: {MOONCAKE_MISSING}"))]


def latent_pool(dtype: torch.dtype, seed: int, storage=None, latent_dim: int = LATENT) -> KVPool:
    """A 32-page pool of random bytes (latent_dim 0: an ordinary pool of the same numbers)."""
    pool = KVPool(KVPoolSpec(32, 4, L, 1, D, dtype, latent_dim=latent_dim), storage=storage)
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return pool


def k_pages(pool: KVPool) -> np.ndarray:
    """A copy of k's bytes, uint8 [L, pages, page_bytes]."""
    return pool.k.view(torch.uint8).reshape(L, pool.k.shape[1] // 4, -1).numpy().copy()


@contextlib.contextmanager
def engines(backend: str, receiver: KVPool, sender: KVPool):
    decode = create_engine(backend, receiver, "decode", timeout_s=10.0)
    prefill = create_engine(backend, sender, "prefill", timeout_s=10.0)
    try:
        yield decode, prefill
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_send_moves_k_once(backend: str, dtype: torch.dtype):
    receiver = latent_pool(dtype, seed=1, storage=pool_storage(backend, "decode"))
    sender = latent_pool(dtype, seed=2)
    before, src = k_pages(receiver), k_pages(sender)
    with engines(backend, receiver, sender) as (decode, prefill):
        desc = json.loads(decode.descriptor())
        assert desc["layout"]["latent_dim"] == LATENT and not {"v", "v_base"} & set(desc)  # no V to map
        moved = prefill.send(decode.descriptor(), SRC, DST)
    assert moved == len(SRC) * L * 4 * D * dtype.itemsize  # k's bytes, once
    expect = before.copy()
    expect[:, DST] = src[:, SRC]
    np.testing.assert_array_equal(k_pages(receiver), expect)


def test_shm_latent_decode_pool_is_one_file():
    receiver = latent_pool(torch.float32, seed=1, storage=pool_storage("shm", "decode"))
    decode = create_engine("shm", receiver, "decode")
    path = json.loads(decode.descriptor())["k"]
    assert os.path.getsize(path) == receiver.k.numel() * 4 == receiver.spec.total_bytes
    decode.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sender_latent", [True, False], ids=["latent-to-ordinary", "ordinary-to-latent"])
def test_latent_and_ordinary_pools_never_exchange_pages(backend: str, sender_latent: bool):
    """Same layers, heads, head_dim, page size and dtype: only the latent flag differs."""
    latent_dims = (LATENT, 0) if sender_latent else (0, LATENT)
    sender = latent_pool(torch.float32, seed=2, latent_dim=latent_dims[0])
    receiver = latent_pool(torch.float32, seed=1, storage=pool_storage(backend, "decode"),
                           latent_dim=latent_dims[1])
    before = k_pages(receiver)
    with engines(backend, receiver, sender) as (decode, prefill):
        with pytest.raises(KVTransferError, match="pages of one do not fit the other") as err:
            prefill.send(decode.descriptor(), SRC, DST)
    assert "latent 32, k only" in str(err.value)
    np.testing.assert_array_equal(k_pages(receiver), before)


# -- PD through the real mesh: a prefill and a decode replica of the tiny DeepSeek-V3 ----------

MESH_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(4 << 20), "--max-requests", "4",
              "--max-running-requests", "4", "--check-invariants"]


@pytest.fixture(scope="module")
def pd_pair(tiny):
    """(prefill, decode) replicas moving latent pages through the shm backend (~20 s to start)."""
    path, _ = tiny
    started = []
    try:
        for mode in ("prefill", "decode"):
            started.append(Mesh("--model", path, *MESH_FLAGS, "--disaggregation-mode", mode,
                                "--disaggregation-transfer-backend", "shm"))
        for mesh in started:
            mesh.wait_ready(timeout=300)
        yield started
        assert [mesh.stop() for mesh in started] == [0, 0]
    finally:
        for mesh in started:
            mesh.kill_all()


def test_pd_mesh_decodes_transformers_tokens_from_sent_latent_pages(tiny, pd_pair):
    _, hf = tiny
    prefill, decode = pd_pair
    for prompt in PROMPTS:  # the second shares 48 tokens with the first: the decode side may reuse them
        req = tokenizer_pb2.GenerateTextRequest(rid=uuid.uuid4().hex, text=" ".join(f"t{i}" for i in prompt),
                                                sampling=greedy(N_NEW))
        got, prefill_side = run_pair(prefill, decode, req)
        assert -1 not in got, got.get(-1)
        assert got[0]["token_ids"] == greedy_continuation(hf, prompt, N_NEW)
        assert prefill_side[0]["token_ids"] == got[0]["token_ids"][:1]  # the prefill side sampled the first
        assert got[0]["usage"][:2] == (len(prompt), N_NEW)
    assert settle(prefill, decode) == [0, 0]  # no page left private on either side
