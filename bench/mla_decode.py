"""The C++ MLA decode kernel (kernels/mla_decode_cpu.py) against its torch reference, in process:
DeepSeek-V2/V3's latent rows (Dk 576 = 512 + 64 rope, v_dim 512), H = 16 query heads, a
bfloat16 pool, contexts of --context tokens on scattered slots, batches 1 and 16.

GB/s counts each request's KV rows once (kv_lens x Dk x 2 bytes over the time): what one pass
over the cache reads, whatever the kernel's head blocking re-reads from cache. Times are the
fastest of repeated calls (the machine is shared: a median mostly measures who else ran).

    .venv/bin/python bench/mla_decode.py [--context 2048] [--batches 1,16] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.quant_kernels import best_ms  # noqa: E402
from kernels import mla_decode_cpu  # noqa: E402

H, DK, V_DIM = 16, 576, 512


def case(batch: int, context: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    slots_total = batch * context + 1024
    kv = torch.randn(slots_total, 1, DK, generator=g).to(torch.bfloat16)
    slots = torch.randperm(slots_total, generator=g)[:batch * context].view(batch, context)  # scattered rows
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, H, DK, generator=g).to(torch.bfloat16)
    scale = 192 ** -0.5  # DeepSeek-V3's qk head dim 128 + 64
    args = (q, kv, slots, lens, scale, V_DIM)
    got, want = mla_decode_cpu.mla_decode_attention(*args), mla_decode_cpu.reference(*args)
    err = (got.float() - want.float()).abs().max().item()
    kernel_ms = best_ms(lambda: mla_decode_cpu.mla_decode_attention(*args))
    torch_ms = best_ms(lambda: mla_decode_cpu.reference(*args))
    gbytes = batch * context * DK * kv.element_size() / 1e9
    return dict(batch=batch, kernel_ms=kernel_ms, torch_ms=torch_ms, gbs=gbytes / (kernel_ms / 1e3),
                torch_gbs=gbytes / (torch_ms / 1e3), speedup=torch_ms / kernel_ms, max_err=err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if mla_decode_cpu.load() is None:
        sys.exit("the CPU MLA decode kernel could not be built here")
    print(f"H={H} Dk={DK} v_dim={V_DIM} bf16 pool, context {args.context}, {torch.get_num_threads()} threads")
    print(f"{'B':>3} {'kernel ms':>10} {'GB/s':>7} {'torch ms':>9} {'GB/s':>7} {'x torch':>8} {'max err':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        r = case(batch, args.context)
        print(f"{r['batch']:>3} {r['kernel_ms']:>10.2f} {r['gbs']:>7.2f} {r['torch_ms']:>9.2f} "
              f"{r['torch_gbs']:>7.2f} {r['speedup']:>8.2f} {r['max_err']:>8.1e}")


if __name__ == "__main__":
    main()
