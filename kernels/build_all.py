"""Build every C++ CPU kernel now (`make setup` runs this), so no service or test pays the
compile on its first request.

Exits 1, printing the compiler's messages, when a kernel fails to build: at run time a worker
falls back to plain torch and logs it, but a set-up that silently lost a kernel would let its
tests skip and CI pass without it. `python -m kernels.build_all NAME...` builds only those
(the names below, e.g. `token_bitmask`)."""
from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

from kernels import cpu_build, cpu_isa, decode_stack, fused_cpu, lora_cpu, mla_decode_cpu, paged_decode_cpu, \
    quant_gemv, token_bitmask_cpu

KERNELS: dict[str, tuple[str, ModuleType]] = {
    "paged_decode": ("paged decode attention", paged_decode_cpu), "fused_ops": ("fused layer ops", fused_cpu),
    "quant_gemv": ("quantized linear", quant_gemv), "decode_stack": ("decode stack", decode_stack),
    "token_bitmask": ("grammar token bitmask", token_bitmask_cpu), "lora": ("multi-LoRA apply", lora_cpu),
    "mla_decode": ("MLA latent decode attention", mla_decode_cpu),
}
ERROR_LINES = 60  # of each failed build's messages, printed


def _build(title: str, module: ModuleType) -> tuple[str, bool]:
    t0 = time.perf_counter()
    built = module.load() is not None
    return f"{title}: {'built' if built else 'FAILED'} in {time.perf_counter() - t0:.1f} s", built


def _failure_messages() -> str:
    parts = []
    for name, text in cpu_build.build_errors.items():
        lines = text.strip().splitlines()
        parts.append(f"--- {name}: the build's last {min(len(lines), ERROR_LINES)} lines ---\n" +
                     "\n".join(lines[-ERROR_LINES:]))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Each kernel is one compiler process, so they build side by side, one per core."""
    argv = sys.argv[1:] if argv is None else argv
    unknown = [name for name in argv if name not in KERNELS]
    if unknown:
        print(f"unknown kernel(s) {unknown}; choose from {sorted(KERNELS)}", file=sys.stderr)
        return 2
    chosen = [KERNELS[name] for name in (argv or KERNELS)]
    logging.basicConfig(level=logging.ERROR, format="%(message)s")  # failures are printed below, whole
    print(f"building the CPU kernels for {cpu_isa.describe()}", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, min(len(chosen), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda kernel: _build(*kernel), chosen))
    for line, _ in results:
        print(line, flush=True)
    if all(built for _, built in results):
        return 0
    print(_failure_messages(), file=sys.stderr)
    print("a CPU kernel failed to build (above); the set-up stops here rather than run and test without it",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
