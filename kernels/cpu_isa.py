"""What this CPU can run, read at run time, and the switch that forces the AVX2 baseline.

Every CPU-specific choice asks this module, never a build-time assumption:
the C++ kernels' compiler flags (`compile_flags`), `--dtype auto`
(`has_fast_bf16`), oneDNN prepacking per dtype (`services/worker/model/linear.py`)
and the tests that exercise an instruction set.

`RADIXMESH_CPU_ISA` chooses:
  native (default)  what /proc/cpuinfo says this CPU has; kernels built with -march=native
  avx2              pretend the CPU has only x86-64-v3 (AVX2, FMA, F16C, BMI): kernels built
                    with -march=x86-64-v3, every optional path (AVX-512, BF16, FP16, AMX) off,
                    and torch's own dispatch held to AVX2 as well (ATEN_CPU_CAPABILITY,
                    ONEDNN_MAX_CPU_ISA, set for child processes; set them before torch is
                    imported to hold this process too, as `make test` does)
It is how the suite checks, on an AVX-512 machine, what an AVX2-only CPU would run.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform

ENV = "RADIXMESH_CPU_ISA"
CHOICES = ("native", "avx2")
# x86-64-v3: what -march=x86-64-v3 may use, so a CPU with these runs the avx2 build.
AVX2_BASELINE = frozenset({"sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm",
                           "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"})
# The flags beyond that baseline that a kernel path or torch's dispatch takes (describe()).
OPTIONAL_PATHS = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "avx512_vnni", "avx_vnni")
# What torch itself reads when the avx2 baseline is forced.
TORCH_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def forced_isa() -> str:
    """The RADIXMESH_CPU_ISA setting ('native' when unset); a clear error for anything else."""
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in CHOICES:
        raise ValueError(f"{ENV} must be one of {CHOICES}, got {value!r}")
    return value


@functools.cache
def _proc_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux names: avx2, avx512f, avx512_bf16, amx_bf16, ...),
    cut down to the AVX2 baseline when that is forced."""
    flags = _proc_flags()
    if forced_isa() == "avx2":
        return flags & AVX2_BASELINE
    return flags


def has(*names: str) -> bool:
    """True when the CPU has every one of these flags."""
    flags = cpu_flags()
    return all(name in flags for name in names)


def has_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ: what the kernels' AVX-512 paths and oneDNN's avx512_core need."""
    return has("avx512f", "avx512bw", "avx512vl", "avx512dq")


def has_fast_bf16() -> bool:
    """bfloat16 matmuls in hardware (AMX-BF16 or AVX-512 BF16): ~5x float32's throughput
    on this project's CPU (bench/ceilings.py), so `--dtype auto` picks bfloat16."""
    return has("amx_bf16") or (has_avx512() and has("avx512_bf16"))


def prepack_missing(dtype_name: str) -> str | None:
    """Why oneDNN cannot prepack `dtype_name` ('bfloat16', 'float16') weights on this CPU,
    or None when it can (torch's own checks: avx512_core or AMX for bf16; AVX512-FP16,
    AVX-NE-CONVERT or AMX-FP16 for fp16)."""
    if dtype_name == "bfloat16":
        return None if has_avx512() or has("amx_bf16") else "bfloat16 prepacking needs AVX-512 (F/BW/VL/DQ) or AMX"
    if dtype_name == "float16":
        return None if has("avx512_fp16") or has("avx_ne_convert") or has("amx_fp16") else \
            "float16 prepacking needs AVX512-FP16, AVX-NE-CONVERT or AMX-FP16"
    return f"{dtype_name} weights are not prepacked"


def compile_flags() -> list[str]:
    """-march for the C++ kernels, plus a define naming the flags they were built for, so a
    build directory carried to another CPU is rebuilt (torch rebuilds when a flag changes)
    instead of running instructions the new CPU lacks."""
    if platform.machine() not in ("x86_64", "AMD64"):
        march = ["-mcpu=native"] if platform.machine() in ("aarch64", "arm64") else []
    else:
        march = ["-march=x86-64-v3"] if forced_isa() == "avx2" else ["-march=native"]
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return [*march, f"-DRADIXMESH_CPU_FLAGS={digest}"]


def build_tag() -> str:
    """A folder name per instruction-set choice, so the two builds do not replace each other."""
    return forced_isa()


def apply_to_torch_env() -> None:
    """With the avx2 baseline forced, hold torch's dispatch to AVX2 in processes started from
    here (the launcher's children). This process keeps what torch already chose."""
    if forced_isa() == "avx2":
        for key, value in TORCH_ENV.items():
            os.environ.setdefault(key, value)


def native_is_avx2_baseline() -> bool:
    """True when this CPU has none of OPTIONAL_PATHS: its native build runs the same kernel
    paths and torch dispatch as the forced avx2 baseline (an AVX2-only CPU such as Zen 3)."""
    return not any(f in _proc_flags() for f in OPTIONAL_PATHS)


def describe() -> str:
    """One line for the worker's start-up log."""
    optional = [f for f in OPTIONAL_PATHS if f in cpu_flags()]
    base = "avx2" if has("avx2", "fma") else "no avx2"
    return f"{ENV}={forced_isa()}: {base}" + (f" + {' '.join(optional)}" if optional else ", no optional ISA")


if __name__ == "__main__":
    # `python -m kernels.cpu_isa`: the describe() line; with --native-is-baseline, exit 0 when
    # native_is_avx2_baseline() (make test then skips its AVX2 rerun), else 1.
    import sys
    print(describe())
    if "--native-is-baseline" in sys.argv[1:]:
        sys.exit(0 if native_is_avx2_baseline() else 1)
