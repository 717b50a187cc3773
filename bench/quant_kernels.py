"""The quantized-weight kernels against dense bfloat16, in process, on the default model's
linear shapes (kernels/quant_gemv.py):

- batch 1 (the fused dot products), per format, vs bf16 F.linear on a oneDNN-prepacked weight
  (services/worker/model/linear.py's packed_linear: what the worker runs dense);
- T = 64 and T = 1024 (the dequantized-tile path) vs the same dense bf16 matmul.
--dense-dtype float32 compares with float32 instead (x float32 too): the dense path of a CPU
without fast bf16, e.g. under RADIXMESH_CPU_ISA=avx2.

Shapes [N, K]: 576x576 (o_proj), 1536x576 (gate or up), 576x1536 (down), 49152x576 (LM head).
k-quants need K a multiple of 256, so only 576x1536 has them. Weights are random (the kernels'
speed does not depend on the values). Times are the fastest of repeated calls (the machine is
shared: a median mostly measures who else ran), on --threads threads (default 1: with 2 cores
shared, an OpenMP team waits for its slowest member's time slice).

    .venv/bin/python bench/quant_kernels.py [--shapes 576x576,...] [--formats Q4_K,...] [--rows 1,64,1024]
                                            [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common.quant_blocks import weight  # noqa: E402  (random valid blocks per format)
from kernels import cpu_isa, quant_gemv  # noqa: E402
from kernels.quant_formats import FORMATS  # noqa: E402
from kernels.quant_gemv import QuantWeight  # noqa: E402

SHAPES = "576x576,1536x576,576x1536,49152x576"
ALL_FORMATS = "Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K,int8"


def best_ms(fn, budget_s: float = 0.4, min_calls: int = 5) -> float:
    """Fastest wall time of fn() in ms, calling it for about budget_s after two warm-up calls."""
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 200:
            break
    return min(times)


def dense(N: int, K: int, dtype: torch.dtype):
    """The dense baseline: F.linear in `dtype`, prepacked for oneDNN where the CPU allows it."""
    from services.worker.model.linear import packed_linear, prepack, prepack_refusal
    w = (torch.randn(N, K) * 0.02).to(dtype)
    if prepack_refusal(dtype) is None:
        packed = prepack(w)
        return lambda x: packed_linear(x, packed, None), "prepacked"
    return lambda x: F.linear(x, w), "F.linear"


def run(shapes: list[tuple[int, int]], formats: list[str], rows: list[int], dtype: torch.dtype) -> None:
    kernel = quant_gemv.load()
    print(f"# {cpu_isa.describe()}; fused path {kernel.fused_path()}, bf16 tiles {kernel.bf16_tiles()}, "
          f"{torch.get_num_threads()} threads")
    name = str(dtype).removeprefix("torch.")
    print(f"| shape NxK | T | format | ms | dense {name} ms | speed vs dense | resident bytes vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for N, K in shapes:
            base_fn, how = dense(N, K, dtype)
            for T in rows:
                x = torch.randn(T, K).to(dtype)
                base = best_ms(lambda: base_fn(x))
                for name in formats:
                    f = FORMATS[name]
                    if K % (f.block or 32):
                        continue
                    qw: QuantWeight = weight(name, N, K)
                    ms = best_ms(lambda: quant_gemv.quant_linear(x, qw, None, kernel))
                    print(f"| {N}x{K} | {T} | {name} | {ms:.3f} | {base:.3f} ({how}) | {base / ms:.2f}x | "
                          f"{qw.nbytes / (N * K * 2):.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--formats", default=ALL_FORMATS)
    ap.add_argument("--rows", default="1,64,1024")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the dense baseline's dtype, and x's (float32: what --dtype auto runs without fast bf16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    run(shapes, args.formats.split(","), [int(r) for r in args.rows.split(",")], getattr(torch, args.dense_dtype))


if __name__ == "__main__":
    main()
