"""Time to first token when a long prompt's prefix sits in each KV tier, vs recomputed.

One run, same machine, same prompt length: the prefix (all but the last few tokens) is
  device        still in the worker's KV pool (plain RadixAttention hit)
  host          demoted to the host tier by a filler prompt, loaded back host -> device
  kvstore-mem   computed by another engine, written through to a kvstore (memory tier),
                prefetched store -> host -> device by a fresh engine on first sight
  kvstore-disk  the same through a kvstore whose memory budget is 0 (every page on disk)
  recompute     nowhere: a fresh prompt of the same length
Loads are forced (--hicache-load-policy always) so each tier is measured, not the
decision. Prints each TTFT as a ratio to recompute, the bytes each load moved and the
GB/s it achieved (the worker's copy time only).

    .venv/bin/python bench/kv_tiers.py --tokens 2000
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from protos.radixmesh.v1 import kvstore_pb2_grpc  # noqa: E402
from services.common.hicache_config import HiCacheConfig  # noqa: E402
from services.common.model_path import default_model_path  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.kvstore.service import KVStoreService  # noqa: E402
from services.kvstore.store import KVStore, StoreConfig  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.tokenizer.text_tokenizer import load_tokenizer  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)


def serve_store(config: StoreConfig) -> tuple[str, KVStore]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    store = KVStore(config)

    async def go() -> int:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(store), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        serve_store.keep.append(server)
        return port
    serve_store.keep = getattr(serve_store, "keep", [])
    port = asyncio.run_coroutine_threadsafe(go(), loop).result(10)
    return f"127.0.0.1:{port}", store


def ttft(eng: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling=ONE)
    assert out.error is None, out.error
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=2, help="recompute is measured this many times (median)")
    args = ap.parse_args()
    path = default_model_path()
    ckpt, tok = load_checkpoint(path), load_tokenizer(path)
    rng = random.Random(0)
    vocab = ckpt.config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.tokens)]

    def engine(kv_tokens: int, **hc) -> Engine:
        worker = WorkerConfig(dtype=args.dtype, page_size=args.page_size, max_requests=4,
                              kv_cache_bytes=None, kv_mem_fraction=None)
        e = Engine(worker=WorkerConfig(dtype=args.dtype, page_size=args.page_size, max_requests=4,
                                       kv_cache_bytes=kv_tokens * bytes_per_token(worker)),
                   scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=-1),
                   checkpoint=ckpt, tokenizer=tok,
                   hicache=HiCacheConfig(**{"hicache_load_policy": "always", "hicache_prefetch_threshold": 0, **hc}))
        ttft(e, prompt()[:64])  # warm-up (kernels, allocator)
        return e

    def bytes_per_token(worker: WorkerConfig) -> int:
        mc = ckpt.config
        elem = 2 if worker.resolved_dtype in ("bfloat16", "float16") else 4
        return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem

    rows: dict[str, tuple[float, int, float]] = {}  # tier -> (ttft s, bytes loaded, transfer s)
    pool = int(args.tokens * 1.6)  # one long prompt fits, two do not: a second one demotes the first
    e = engine(pool, host_kv_ratio=4.0)
    recompute = statistics.median(ttft(e, prompt()) for _ in range(args.reps))
    p = prompt()
    ttft(e, p)
    rows["device"] = (ttft(e, p[:-8] + prompt()[:8]), 0, 0.0)
    p = prompt()
    ttft(e, p)
    ttft(e, prompt())  # the filler: p's pages go to the host tier
    s = e.scheduler.stats
    b0, t0 = s.bytes_host_to_device, s.transfer_seconds
    rows["host"] = (ttft(e, p[:-8] + prompt()[:8]), s.bytes_host_to_device - b0, s.transfer_seconds - t0)
    e.shutdown()

    with tempfile.TemporaryDirectory() as tmp:
        for tier, memory in (("kvstore-mem", 4 << 30), ("kvstore-disk", 0)):
            addr, _ = serve_store(StoreConfig(memory_bytes=memory, disk_dir=str(Path(tmp) / tier),
                                              disk_bytes=8 << 30))
            a = engine(pool, kvstore_addr=addr)
            p = prompt()
            ttft(a, p)
            a.flush_kv_writes()
            a.shutdown()
            b = engine(pool, kvstore_addr=addr)
            s = b.scheduler.stats
            b0, t0 = s.bytes_store_to_host + s.bytes_host_to_device, s.transfer_seconds
            took = ttft(b, p[:-8] + prompt()[:8])
            rows[tier] = (took, s.bytes_store_to_host + s.bytes_host_to_device - b0, s.transfer_seconds - t0)
            assert s.store_hit_tokens > 0, f"{tier}: the store served nothing"
            b.shutdown()

    print(f"prompt {args.tokens} tokens, page size {args.page_size}, dtype {args.dtype}; "
          f"recompute TTFT {recompute:.3f} s (median of {args.reps})")
    print(f"{'prefix in':<14}{'TTFT s':>9}{'x recompute':>13}{'MB moved':>10}{'copy s':>9}{'GB/s':>7}")
    for tier, (took, nbytes, secs) in rows.items():
        gbs = f"{nbytes / secs / 1e9:7.2f}" if secs > 0 and nbytes else "      -"
        print(f"{tier:<14}{took:9.3f}{took / recompute:13.3f}{nbytes / 1e6:10.1f}{secs:9.3f}{gbs}")
    print(f"{'recompute':<14}{recompute:9.3f}{1.0:13.3f}")


if __name__ == "__main__":
    main()
