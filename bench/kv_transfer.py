"""PD KV transfer bandwidth per backend, between two processes on loopback, next to memcpy.

A decode process serves one pool per backend (services/worker/kv_transfer); this process is
the prefill side and sends --mib of pages into it, best of --runs sends (each blocks until the
bytes are in place), in two page patterns:
  contiguous  one run of consecutive pages into one run (one range per layer and tensor)
  scattered   every other source page into shuffled destinations (one range per page)
memcpy is torch's copy of the same number of bytes in this process, measured again beside every
row (a shared machine's bandwidth drifts): each row's ratio is to the memcpy measured with it.
The decode side checks the last send's bytes (a checksum of its destination pages).

    flock /tmp/bench.lock .venv/bin/python bench/kv_transfer.py --mib 64
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.worker.kv_pool import KVPool, KVPoolSpec  # noqa: E402
from services.worker.kv_transfer import TRANSFER_BACKENDS, KVTransferError, create_engine, pool_storage  # noqa: E402
from services.worker.kv_transfer.layout import PoolLayout  # noqa: E402

# A pool shaped like an 8B model's (8 KV heads x 128, bf16), 8 layers: a page moves 512 KiB.
LAYERS, HEADS, HEAD_DIM, PAGE = 8, 8, 128, 16


def pool_spec(mib: int) -> KVPoolSpec:
    """Room for twice --mib of pages (the scattered pattern reads every other page)."""
    probe = KVPoolSpec(1, PAGE, LAYERS, HEADS, HEAD_DIM, torch.bfloat16)
    pages = (mib << 20) // (probe.bytes_per_token * PAGE)
    return KVPoolSpec(2 * pages + 2, PAGE, LAYERS, HEADS, HEAD_DIM, torch.bfloat16)


def page_bytes(pool: KVPool, pages: list[int]) -> torch.Tensor:
    lay = PoolLayout.of(pool)
    shape = (lay.num_layers, lay.num_pages, lay.page_bytes)
    return torch.stack([t.view(torch.uint8).reshape(shape)[:, pages] for t in (pool.k, pool.v)])


def checksum(t: torch.Tensor) -> int:
    return int(t.view(torch.int64).sum())  # wraps around: equal bytes, equal sums


def decode_main(backends: list[str], mib: int, conn) -> None:
    """The decode side: an engine per backend; answers ("sum", backend, pages) until EOF."""
    pools, engines = {}, {}
    for b in backends:
        pools[b] = KVPool(pool_spec(mib), storage=pool_storage(b, "decode"))
        engines[b] = create_engine(b, pools[b], "decode", host="127.0.0.1")
    conn.send({b: e.descriptor() for b, e in engines.items()})
    try:
        while True:
            _, backend, pages = conn.recv()
            conn.send(checksum(page_bytes(pools[backend], pages)))
    except EOFError:
        pass
    for e in engines.values():
        e.close()


def patterns(n: int, total_pages: int) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(0)
    scattered_dst = list(range(total_pages - n, total_pages))
    rng.shuffle(scattered_dst)
    return {"contiguous": (list(range(n)), list(range(1, n + 1))),
            "scattered": (list(range(0, 2 * n, 2)), scattered_dst)}


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes per send, in MiB")
    ap.add_argument("--runs", type=int, default=5, help="sends per backend and pattern; the best counts")
    ap.add_argument("--backends", default=",".join(TRANSFER_BACKENDS))
    args = ap.parse_args()

    spec = pool_spec(args.mib)
    n = (args.mib << 20) // (spec.bytes_per_token * PAGE)
    nbytes = n * spec.bytes_per_token * PAGE
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"# {nbytes / 2**20:.0f} MiB a send: {n} pages of {spec.bytes_per_token * PAGE >> 10} KiB "
          f"({LAYERS} layers x k,v x {PAGE} tokens x {HEADS} heads x {HEAD_DIM} bf16), best of {args.runs}")

    src_bytes = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst_bytes = torch.zeros_like(src_bytes)

    def memcpy_gbs() -> float:
        return nbytes / best_of(args.runs, lambda: dst_bytes.copy_(src_bytes)) / 1e9

    sender = KVPool(spec)
    for t in (sender.k, sender.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    wanted = [b for b in args.backends.split(",") if b]
    usable = []
    for b in wanted:
        try:
            create_engine(b, KVPool(KVPoolSpec(2, PAGE, 1, 1, 8, torch.bfloat16)), "prefill").close()
            usable.append(b)
        except KVTransferError as e:
            print(f"{b:<24} unavailable: {e}")

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(usable, args.mib, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not conn.poll(120):
            raise SystemExit("the decode process did not start within 120 s")
        descriptors = conn.recv()
        for backend in usable:
            engine = create_engine(backend, sender, "prefill", timeout_s=120)
            for name, (src, dst) in patterns(n, spec.num_pages).items():
                engine.send(descriptors[backend], src, dst)  # warm: connections, the receiver's first touch
                gbs = nbytes / best_of(args.runs, lambda: engine.send(descriptors[backend], src, dst)) / 1e9
                memcpy = memcpy_gbs()
                conn.send(("sum", backend, dst))
                ok = conn.poll(120) and conn.recv() == checksum(page_bytes(sender, src))
                print(f"{backend + ' ' + name:<24} {gbs:8.2f} GB/s   memcpy {memcpy:6.2f} GB/s   {gbs / memcpy:5.2f}x"
                      f"{'' if ok else '   WRONG BYTES AT THE RECEIVER'}")
            engine.close()
    finally:
        conn.close()
        proc.join(60)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
