"""Multi-LoRA on the real model through the Engine: a mixed batch of four random adapters (ranks
8 and 16, every target module, alpha != rank, rsLoRA) plus base requests, submitted staggered
and prefilled in chunks, gives PEFT's merged-model greedy output for each; no prefix is ever
shared across adapters or with the base model, in the radix cache or in the kvstore; adapters
load and unload at run time."""
from __future__ import annotations

import queue
import time

import pytest

from bench.common.random_adapter import make_random_adapter
from services.common.admin_error import AdminError
from services.common.hicache_config import HiCacheConfig
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.integration.reference import assert_matches, greedy_reference
from tests.integration.test_hicache_engine import StoreServer
from tests.unit.lora_fixtures import merged

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
# name → (rank, lora_alpha, use_rslora, seed)
ADAPTERS = {"r8": (8, 16, False, 1), "r16": (16, 16, False, 2), "r8-rslora": (8, 32, True, 3),
            "r16-a64": (16, 64, False, 4)}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, hf_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_random_adapter(hf_model, str(root / name), rank, alpha, seed=seed, use_rslora=rslora)
            for name, (rank, alpha, rslora, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "Write a haiku about the sea. A haiku about the sea has three lines:" * 3]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def references(hf_model, adapter_dirs, prompts):
    """PEFT's merged model per adapter ("" = the base model): its greedy tokens per prompt."""
    refs = {"": [greedy_reference(hf_model, ids, NEW_TOKENS) for ids in prompts]}
    for name, path in adapter_dirs.items():
        model = merged(hf_model, path)
        refs[name] = [greedy_reference(model, ids, NEW_TOKENS) for ids in prompts]
        del model
    return refs


def make_engine(checkpoint, tokenizer, adapter_dirs, *, max_loras=4, chunk=32, **hicache) -> Engine:
    worker = WorkerConfig(dtype="float32", page_size=16, kv_cache_bytes=256 << 20, max_requests=32,
                          lora_paths=tuple(f"{n}={p}" for n, p in adapter_dirs.items()), max_loras=max_loras)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=32, chunked_prefill_size=chunk),
                  checkpoint=checkpoint, tokenizer=tokenizer,
                  hicache=HiCacheConfig(hicache_prefetch_threshold=16, hicache_load_policy="always", **hicache)
                  if hicache else None)


def submit(eng: Engine, ids: list[int], adapter: str) -> queue.SimpleQueue:
    q: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(ids, GREEDY, q.put, adapter=adapter)
    return q


def collect(q: queue.SimpleQueue) -> tuple[list[int], int]:
    tokens, cached = [], 0
    while True:
        chunk = q.get(timeout=300)
        assert chunk.error is None, chunk.error
        tokens += chunk.token_ids
        cached = chunk.cached_tokens
        if chunk.finished:
            return tokens, cached


def test_mixed_staggered_chunked_batch_equals_peft_merged(checkpoint, tokenizer, adapter_dirs, prompts, references):
    eng = make_engine(checkpoint, tokenizer, adapter_dirs)
    try:
        pending = []
        for round_ in range(len(prompts)):  # each round joins while the last one decodes
            for adapter in ["", *ADAPTERS]:
                pending.append((adapter, round_, submit(eng, prompts[round_], adapter)))
            time.sleep(0.3)
        for adapter, i, q in pending:
            tokens, _ = collect(q)
            assert_matches(tokens, references[adapter][i], f"adapter {adapter or 'base'!r} prompt {i}")
        assert eng.scheduler.stats.steps > 0
    finally:
        eng.shutdown()


def test_more_adapters_than_slots_wait_their_turn(checkpoint, tokenizer, adapter_dirs, prompts, references):
    eng = make_engine(checkpoint, tokenizer, adapter_dirs, max_loras=2)
    try:
        queues = [(a, submit(eng, prompts[0], a)) for a in ADAPTERS]
        for adapter, q in queues:
            assert_matches(collect(q)[0], references[adapter][0], f"adapter {adapter!r} with 2 slots")
    finally:
        eng.shutdown()


def test_no_prefix_is_shared_across_adapters_radix_or_kvstore(checkpoint, tokenizer, adapter_dirs, prompts,
                                                              tmp_path):
    ids = prompts[2]  # > 3 pages
    server = StoreServer(tmp_path / "kv").start()
    try:
        a = make_engine(checkpoint, tokenizer, adapter_dirs, kvstore_addr=server.address)
        try:
            assert collect(submit(a, ids, "r8"))[1] == 0
            for other in ("r16", ""):  # the radix cache holds r8's pages: none serves another
                assert collect(submit(a, ids, other))[1] == 0, f"{other or 'base'} hit r8's prefix"
            assert collect(submit(a, ids, "r8"))[1] >= 16, "r8's own prefix is reused"
            a.flush_kv_writes()
            assert a.scheduler.stats.pages_written_to_store > 0
        finally:
            a.shutdown()
        b = make_engine(checkpoint, tokenizer, adapter_dirs, kvstore_addr=server.address)  # a second replica
        try:
            assert collect(submit(b, ids, "r8-rslora"))[1] == 0
            assert b.scheduler.stats.store_hit_tokens == 0, "the store served another adapter's pages"
            assert collect(submit(b, ids, "r8"))[1] >= 16, "the store serves r8's pages to r8"
            assert b.scheduler.stats.store_hit_tokens >= 16
        finally:
            b.shutdown()
    finally:
        server.close()


def test_load_and_unload_at_run_time(checkpoint, tokenizer, adapter_dirs, prompts, references, tmp_path):
    eng = make_engine(checkpoint, tokenizer, {})
    try:
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'r16'"):
            eng.generate(input_ids=prompts[0], sampling=GREEDY, adapter="r16")
        state = eng.load_lora_adapter("r16", adapter_dirs["r16"])
        assert [a.name for a in state.adapters] == ["r16"] and state.adapters[0].rank == 16
        out = eng.generate(input_ids=prompts[0], sampling=GREEDY, adapter="r16")
        assert_matches(out.token_ids, references["r16"][0], "r16 loaded at run time")
        with pytest.raises(AdminError, match="adapter_config.json"):
            eng.load_lora_adapter("broken", str(tmp_path))
        state = eng.unload_lora_adapter("r16")
        assert list(state.adapters) == []
        with pytest.raises(AdminError) as e:
            eng.unload_lora_adapter("r16")
        assert e.value.code == "not_found"
    finally:
        eng.shutdown()
