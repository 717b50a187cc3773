"""FP8 KV pages through HiCache on the real model: demoted to the host tier and loaded back,
and written to a real kvstore then served to a second engine, they give the tokens a
recompute gives (the float32 model: deterministic whatever the batching), at half a bf16
page's bytes; an FP8 engine never hits a bf16 engine's pages in the shared store."""
from __future__ import annotations

import pytest

from services.common.hicache_config import HiCacheConfig
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.integration.test_hicache_engine import StoreServer, gen

FP8_TOKEN_BYTES = 2 * 30 * 3 * 64  # SmolLM2-135M KV per token, one byte an element


def _engine(checkpoint, tokenizer, kv="fp8_e4m3", dtype="float32", kv_tokens=160, radix=True, **hicache) -> Engine:
    token_bytes = FP8_TOKEN_BYTES * (1 if kv != "auto" else 4)
    worker = WorkerConfig(dtype=dtype, kv_cache_dtype=kv, page_size=16, kv_cache_bytes=kv_tokens * token_bytes,
                          max_requests=4)
    hc = HiCacheConfig(**{"hicache_prefetch_threshold": 16, "hicache_load_policy": "always", **hicache})
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=4, disable_radix_cache=not radix),
                  checkpoint=checkpoint, tokenizer=tokenizer, hicache=hc)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    system = ("You are a careful assistant for a public library. Answer briefly, cite the shelf "
              "section when you can, and never invent a book title that you are not sure exists. "
              "Visitors may be children, students or researchers; adapt your tone to each of them, "
              "and point them to the front desk for anything about membership cards. ")
    return [tokenizer.encode(system + q) for q in ("Where are the atlases?", "Do you lend telescopes?",
                                                   "What are the opening hours on Sunday?")]


@pytest.fixture(scope="module")
def recomputed(checkpoint, tokenizer, prompts):
    eng = _engine(checkpoint, tokenizer, kv_tokens=640, radix=False)
    try:
        return [gen(eng, ids)[0] for ids in prompts]
    finally:
        eng.shutdown()


def test_fp8_pages_demoted_to_host_and_loaded_back_give_the_recomputed_tokens(checkpoint, tokenizer, prompts,
                                                                               recomputed):
    eng = _engine(checkpoint, tokenizer, host_kv_ratio=4.0)
    fillers = [tokenizer.encode(f"Filler {i}: " + "the quick brown fox jumps over the lazy dog " * 6)
               for i in range(3)]
    try:
        assert gen(eng, prompts[0]) == (recomputed[0], 0)
        for ids in fillers:  # push the system prompt out of the 160-token pool: demoted
            gen(eng, ids)
        s = eng.scheduler.stats
        assert s.pages_demoted > 0
        assert s.bytes_device_to_host == s.pages_demoted * 16 * FP8_TOKEN_BYTES  # one byte an element
        out, cached = gen(eng, prompts[2])  # its prefix comes back from the host tier
        assert out == recomputed[2] and cached >= 64
        assert s.host_hit_tokens >= 48
        eng.scheduler.check_invariants()
    finally:
        eng.shutdown()


def test_fp8_pages_in_the_kvstore_serve_a_second_engine_and_never_a_bf16_one(checkpoint, tokenizer, prompts,
                                                                             recomputed, tmp_path):
    server = StoreServer(tmp_path / "kv").start()
    try:
        a = _engine(checkpoint, tokenizer, kvstore_addr=server.address)
        try:
            assert gen(a, prompts[0])[0] == recomputed[0]
            a.flush_kv_writes()
            assert a.scheduler.stats.pages_written_to_store > 0
        finally:
            a.shutdown()
        b = _engine(checkpoint, tokenizer, kvstore_addr=server.address)
        try:
            out, cached = gen(b, prompts[1])
            assert out == recomputed[1] and cached >= 64 and b.scheduler.stats.store_hit_tokens >= 64
        finally:
            b.shutdown()
        c = _engine(checkpoint, tokenizer, kv="auto", kvstore_addr=server.address)  # float32 KV, same model
        try:
            gen(c, prompts[2])
            assert c.scheduler.stats.store_hit_tokens == 0  # the fp8 pages are not its pages
        finally:
            c.shutdown()
    finally:
        server.close()
