"""Build every C++ CPU kernel now (`make setup` runs this), so no service or test pays the
compile on its first request. Exits 0 even when a kernel cannot be built: the torch paths remain."""
from __future__ import annotations

import logging
import sys
import time

from kernels import decode_stack, fused_cpu, paged_decode_cpu, quant_gemv


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, module in (("paged decode attention", paged_decode_cpu), ("fused layer ops", fused_cpu),
                         ("quantized linear", quant_gemv), ("decode stack", decode_stack)):
        t0 = time.perf_counter()
        built = module.load() is not None
        print(f"{name}: {'built' if built else 'UNAVAILABLE (torch fallback)'} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
