#!/usr/bin/env python
"""KV store throughput: put/get GB/s of the memory and disk tiers vs torch.save/load and raw
file writes/reads of the same pages, measured in the same run (best of --reps).

    .venv/bin/python bench/kvstore_throughput.py                 # SmolLM2-135M pages, bf16, 16 tokens
    .venv/bin/python bench/kvstore_throughput.py --pages 256 --dir /mnt/nvme/kvbench --no-grpc

Rows:
  store memory put/get   KVStore core in-process, pages held in memory (put includes the crc32;
                         get hands back the stored bytes objects, no copy: an upper bound)
  store disk put/get     memory budget 0: every put writes a page file, every get reads and checks one
  grpc memory put/get    KVStoreClient → `radixmesh serve kvstore` on loopback (tensor encode/decode,
                         protobuf, gRPC, the store), memory tier
  peer torch.save/load   one torch.save / torch.load(weights_only) file per page
  peer raw write/read    one open/write/close and open/read per page, the same bytes, no header/crc

Disk reads come from the OS page cache right after the writes (no root to drop it): they
measure the store's read path (open, header, crc32), not the device. GB = 1e9 bytes of payload.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.common.page_hash import KeyNamespace, PageHasher  # noqa: E402
from services.kvstore import page_codec  # noqa: E402
from services.kvstore.store import KVStore, StoreConfig  # noqa: E402


def best(reps: int, setup: Callable[[], None], run: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        setup()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--grpc", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the client against `radixmesh serve kvstore` on loopback")
    args = p.parse_args()

    spec = page_codec.PageSpec(args.layers, args.page_size, args.kv_heads, args.head_dim, getattr(torch, args.dtype))
    hasher = PageHasher(KeyNamespace("bench", "0", "", spec.page_size, spec.layout))
    keys = hasher.keys(list(range(args.pages * spec.page_size)))
    pages = torch.randn((args.pages, *spec.shape)).to(spec.dtype)
    payloads = [page_codec.encode(t, spec) for t in pages]
    total = len(payloads) * spec.nbytes
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"{args.pages} pages of {spec.shape} {args.dtype} = {spec.nbytes / 1e6:.3f} MB each, "
          f"{total / 1e6:.1f} MB per pass; best of {args.reps}; scratch {scratch}")
    results: dict[str, float] = {}

    def fresh(sub: str) -> Path:
        d = scratch / sub
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    # -- store, memory tier
    holder: dict[str, KVStore] = {}
    big = StoreConfig(memory_bytes=2 * total, disk_dir=None)
    results["store memory put"] = best(args.reps, lambda: holder.update(s=KVStore(big)),
                                       lambda: holder["s"].put_many(zip(keys, payloads)))
    assert holder["s"].stats().memory_pages == len(keys)
    results["store memory get"] = best(args.reps, lambda: None, lambda: holder["s"].get_many(keys))

    # -- store, disk tier
    def disk_setup() -> None:
        holder["s"] = KVStore(StoreConfig(memory_bytes=0, disk_dir=str(fresh("store")), disk_bytes=4 * total))

    results["store disk put"] = best(args.reps, disk_setup, lambda: holder["s"].put_many(zip(keys, payloads)))
    disk_cfg = holder["s"].config
    results["store disk get"] = best(args.reps, lambda: holder.update(s=KVStore(disk_cfg)),
                                     lambda: holder["s"].get_many(keys))
    assert holder["s"].stats().hits_disk == len(keys)

    # -- peers: torch.save/load and raw files
    singles = [t.clone() for t in pages]  # torch.save of a view would write the whole batch's storage

    def save_all() -> None:
        d = scratch / "torch"
        for i, t in enumerate(singles):
            torch.save(t, d / f"{i}.pt")

    results["peer torch.save"] = best(args.reps, lambda: fresh("torch"), save_all)
    results["peer torch.load"] = best(args.reps, lambda: None, lambda: [
        torch.load(scratch / "torch" / f"{i}.pt", weights_only=True) for i in range(len(pages))])

    def raw_write() -> None:
        d = scratch / "raw"
        for i, b in enumerate(payloads):
            with open(d / f"{i}.bin", "wb") as f:
                f.write(b)

    def raw_read() -> None:
        for i in range(len(payloads)):
            with open(scratch / "raw" / f"{i}.bin", "rb") as f:
                f.read()

    results["peer raw write"] = best(args.reps, lambda: fresh("raw"), raw_write)
    results["peer raw read"] = best(args.reps, lambda: None, raw_read)

    if args.grpc:
        results.update(asyncio.run(grpc_rows(spec, keys, pages, args.reps)))

    print(f"\n{'what':<22}{'seconds':>10}{'GB/s':>9}")
    for name, t in results.items():
        print(f"{name:<22}{t:>10.4f}{total / t / 1e9:>9.2f}")
    gbs = {k: total / t / 1e9 for k, t in results.items()}
    print("\nratios (store / peer GB/s):")
    for store_row, peer_row in [("store disk put", "peer torch.save"), ("store disk put", "peer raw write"),
                                ("store disk get", "peer torch.load"), ("store disk get", "peer raw read"),
                                ("store memory put", "peer raw write"), ("store memory get", "peer raw read")]:
        print(f"  {store_row} / {peer_row}: {gbs[store_row] / gbs[peer_row]:.2f}x")
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


async def grpc_rows(spec: page_codec.PageSpec, keys: list[bytes], pages: torch.Tensor,
                    reps: int) -> dict[str, float]:
    """The client against a real `radixmesh serve kvstore` subprocess (memory tier)."""
    import json
    import subprocess

    from services.kvstore.client import KVStoreClient

    repo = Path(__file__).resolve().parent.parent
    total = len(keys) * spec.nbytes
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "kvstore", "--listen", "127.0.0.1:0",
                             "--kvstore-memory-bytes", str(4 * total), "--log-level", "info"],
                            cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        while port is None:
            line = await asyncio.to_thread(proc.stderr.readline)
            if not line:
                raise RuntimeError("kvstore exited before listening")
            if '"listening"' in line:
                port = json.loads(line)["port"]
        client = KVStoreClient(f"127.0.0.1:{port}", spec, timeout_s=30)
        while await client.stats() is None:  # until SERVING
            await asyncio.sleep(0.2)
            client._down_until = None  # noqa: SLF001 - probe again at once
        out = {}
        times = []
        for _ in range(reps):
            await client.clear()
            t0 = time.perf_counter()
            stored = await client.put(keys, pages)
            times.append(time.perf_counter() - t0)
            assert stored == len(keys), stored
        out["grpc memory put"] = min(times)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            got = await client.get_prefix(keys)
            times.append(time.perf_counter() - t0)
            assert got.shape[0] == len(keys)
        out["grpc memory get"] = min(times)
        assert client.counters.failures == 0
        await client.close()
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
