"""CPU features are read at run time, the AVX2 baseline can be forced, and every CPU-specific
choice (kernel flags, --dtype auto, prepacking per dtype, the start-up warnings) follows them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from kernels import cpu_build, cpu_isa, decode_stack, fused_cpu, paged_decode_cpu, quant_gemv
from services.worker import fallbacks
from services.worker.config import WorkerConfig
from services.worker.model import linear

# /proc/cpuinfo flags of the machines the suite runs on (trimmed to what matters here).
AMD_EPYC = frozenset("sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe avx512f avx512dq "
                     "avx512bw avx512vl avx512_bf16 avx512_vnni".split())
INTEL_SPR = AMD_EPYC | {"avx512_fp16", "amx_bf16", "amx_tile", "avx_vnni"}
AVX2_ONLY = frozenset("sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe".split())


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU with the given flags (and optionally an RADIXMESH_CPU_ISA value)."""
    def pretend(flags: frozenset[str], isa: str | None = None) -> None:
        monkeypatch.setattr(cpu_isa, "_proc_flags", lambda: flags)
        if isa is None:
            monkeypatch.delenv(cpu_isa.ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_isa.ENV, isa)
        linear.prepack_refusal.cache_clear()
    yield pretend
    linear.prepack_refusal.cache_clear()


def test_amd_epyc_packs_bf16_but_not_fp16(cpu):
    cpu(AMD_EPYC)
    assert cpu_isa.has_fast_bf16() and cpu_isa.has_avx512()
    assert cpu_isa.prepack_missing("bfloat16") is None
    assert "AVX512-FP16" in cpu_isa.prepack_missing("float16")
    assert "AVX512-FP16" in linear.prepack_refusal(torch.float16)
    layer = linear.Linear(32, 16, bias=False).to(torch.float16)
    assert not layer.prepack() and layer.packed is None  # falls back instead of oneDNN's error
    x = torch.randn(3, 32, dtype=torch.float16)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert WorkerConfig().resolved_dtype == "bfloat16"


def test_intel_packs_both_where_onednn_agrees(cpu):
    cpu(INTEL_SPR)
    assert cpu_isa.prepack_missing("bfloat16") is None and cpu_isa.prepack_missing("float16") is None


def test_avx2_only_cpu_runs_float32_unpacked(cpu):
    cpu(AVX2_ONLY)
    assert not cpu_isa.has_fast_bf16() and not cpu_isa.has_avx512()
    assert WorkerConfig().resolved_dtype == "float32"
    assert "AVX-512" in linear.prepack_refusal(torch.bfloat16)
    found = fallbacks.cpu_fallbacks(WorkerConfig(), prepacked=False)
    assert any("--dtype auto runs float32" in line for line in found)
    assert any("256-bit AVX2 paths" in line for line in found)
    bf16 = fallbacks.cpu_fallbacks(WorkerConfig(dtype="bfloat16"), prepacked=False)
    assert any("bfloat16 linears run unpacked" in line and "AVX-512" in line for line in bf16)


def test_forcing_avx2_hides_every_optional_flag(cpu):
    cpu(INTEL_SPR, isa="avx2")
    assert cpu_isa.forced_isa() == "avx2" and cpu_isa.build_tag() == "avx2"
    assert cpu_isa.cpu_flags() <= cpu_isa.AVX2_BASELINE and cpu_isa.has("avx2", "fma")
    assert not cpu_isa.has_avx512() and not cpu_isa.has_fast_bf16()
    assert cpu_isa.prepack_missing("bfloat16") and cpu_isa.prepack_missing("float16")
    assert WorkerConfig().resolved_dtype == "float32"
    assert "-march=x86-64-v3" in cpu_isa.compile_flags()
    assert cpu_build.build_root().endswith("avx2")


def test_make_test_skips_its_avx2_rerun_only_where_native_is_the_baseline(cpu):
    """An AVX2-only CPU's native build already runs the baseline's paths; any optional ISA
    (AVX-512, AVX-VNNI alone included) keeps the rerun, and forcing avx2 does not hide them."""
    cpu(AVX2_ONLY | {"sha_ni", "vaes"})  # Zen 3's extras take no kernel path
    assert cpu_isa.native_is_avx2_baseline()
    for flags in (AMD_EPYC, INTEL_SPR, AVX2_ONLY | {"avx_vnni"}):
        cpu(flags, isa="avx2")
        assert not cpu_isa.native_is_avx2_baseline(), flags


def test_native_build_is_keyed_by_the_cpu(cpu):
    cpu(INTEL_SPR)
    intel = cpu_isa.compile_flags()
    cpu(AMD_EPYC)
    amd = cpu_isa.compile_flags()
    assert "-march=native" in intel and "-march=native" in amd
    assert intel != amd  # a build carried to the other CPU is rebuilt, not run with missing instructions
    assert cpu_build.build_root().endswith("native")


def test_unknown_isa_choice_is_a_clear_error(cpu):
    cpu(INTEL_SPR, isa="avx9")
    with pytest.raises(ValueError, match="RADIXMESH_CPU_ISA must be one of"):
        cpu_isa.cpu_flags()


def test_forced_avx2_reaches_torch_in_child_processes(cpu, monkeypatch):
    cpu(INTEL_SPR, isa="avx2")
    for key in cpu_isa.TORCH_ENV:
        monkeypatch.delenv(key, raising=False)
    cpu_isa.apply_to_torch_env()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_a_kernel_that_cannot_build_is_named_with_its_reason(monkeypatch):
    monkeypatch.setattr(cpu_build, "unavailable", {"quant_gemv": "CalledProcessError: error: bad flag"})
    found = fallbacks.cpu_fallbacks(WorkerConfig(), prepacked=True)
    assert any(line.startswith("CPU kernel quant_gemv: CalledProcessError") for line in found)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_every_kernel_builds_for_this_cpu():
    """Where a compiler exists, no kernel may fall back silently: a kernel that stopped
    compiling for this instruction set (say under RADIXMESH_CPU_ISA=avx2) fails here, not as
    skipped kernel tests."""
    for module in (paged_decode_cpu, fused_cpu, quant_gemv, decode_stack):
        assert module.load() is not None, cpu_build.unavailable
    assert cpu_build.unavailable == {}


def test_the_cli_refuses_an_unknown_isa_before_starting_anything():
    env = {**os.environ, cpu_isa.ENV: "avx9"}
    run = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "RADIXMESH_CPU_ISA must be one of" in run.stderr
