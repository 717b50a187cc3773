"""The CPU paged decode attention alone (kernels/cpu/paged_attention.h through the
`paged_decode_attention` op): one request's query against `--length` KV rows, for each of a
30-layer model's layers in turn (the default model's 9 query and 3 KV heads of 64), with the
caches swept between layers as a step's weight reads sweep them. Prints the best of
`--repeats` passes, in ms per step (one Python call per layer included: compare kernels on one
machine, not with the one-call step's own timers).

    .venv/bin/python bench/decode_attention.py [--length 128,1024] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kernels import cpu_isa, paged_decode_cpu  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, SLOTS = 30, 9, 3, 64, 1 << 14


def one_step_ms(k: torch.Tensor, v: torch.Tensor, length: int, repeats: int) -> float:
    slots = torch.arange(1000, 1000 + length, dtype=torch.int64).view(1, -1)  # one request's rows
    lens = torch.tensor([length], dtype=torch.int64)
    q = torch.randn(1, HEADS, HEAD_DIM)
    sweep = torch.empty(8 << 20, dtype=torch.uint8)  # a layer's weights passing through the caches

    def one_pass() -> float:
        total = 0.0
        for layer in range(LAYERS):
            sweep.add_(1)
            t0 = time.perf_counter()
            paged_decode_cpu.paged_decode_attention(q, k[layer], v[layer], slots, lens, HEAD_DIM ** -0.5)
            total += time.perf_counter() - t0
        return total

    for _ in range(3):
        one_pass()
    return 1e3 * min(one_pass() for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", default="128,1024", help="KV rows, comma-separated")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if paged_decode_cpu.load() is None:
        print("paged decode attention: not built")
        return 1
    dtype = getattr(torch, args.dtype)
    k = torch.randn(LAYERS, SLOTS, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(LAYERS, SLOTS, KV_HEADS, HEAD_DIM).to(dtype)
    print(f"{cpu_isa.describe()}; {torch.get_num_threads()} threads; {args.dtype} KV")
    for length in (int(n) for n in args.length.split(",")):
        print(f"{length:>6} rows: {one_step_ms(k, v, length, args.repeats):.3f} ms for {LAYERS} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
