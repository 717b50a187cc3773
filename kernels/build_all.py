"""Build every C++ CPU kernel now (`make setup` runs this), so no service or test pays the
compile on its first request. Exits 0 even when a kernel cannot be built: the torch paths remain."""
from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from kernels import cpu_isa, decode_stack, fused_cpu, lora_cpu, paged_decode_cpu, quant_gemv, token_bitmask_cpu


KERNELS = (("paged decode attention", paged_decode_cpu), ("fused layer ops", fused_cpu),
           ("quantized linear", quant_gemv), ("decode stack", decode_stack),
           ("grammar token bitmask", token_bitmask_cpu), ("multi-LoRA apply", lora_cpu))


def _build(name: str, module) -> str:
    t0 = time.perf_counter()
    built = module.load() is not None
    return f"{name}: {'built' if built else 'UNAVAILABLE (torch fallback)'} in {time.perf_counter() - t0:.1f} s"


def main() -> int:
    """Each kernel is one compiler process, so they build side by side, one per core."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"building the CPU kernels for {cpu_isa.describe()}", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, min(len(KERNELS), os.cpu_count() or 1))) as pool:
        for line in pool.map(lambda k: _build(*k), KERNELS):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
