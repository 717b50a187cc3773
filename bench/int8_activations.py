"""Issue 22's open question, decided by measurement: do int8 activations with integer dot
products (llama.cpp's way: x quantized per group of 32, VNNI's u8 x s8 dot products) beat the
worker's float32-activation kernel on the GGUF blocks (kernels/cpu/quant_gemv.h)?

Both run every linear of one decode step of the default model on its own Q4_1 / Q8_0 weights
(30 layers of q, k, v, o, gate, up, down, then the Q8_0 LM head), one Python call per linear
for both, for 1 to 8 rows (a decode step, or a verify step of 8 rows). The probe kernel is
the worker's own (kernels/cpu/int8_activations.h: AVX512-VNNI, or the 256-bit AVX2 path of
int8_activations_avx2.h, named by the instructions this build has: `quant_linear(...,
int8_activations=True)`, the worker's --quant-activations int8) and, where the CPU has AVX-VNNI,
the 256-bit AVX-VNNI probe in bench/kernels/int8_activation_probe.cpp. Printed per row count:
each kernel's fastest step time, the ratio int8 / float32, the step's weight bytes over that
time as a fraction of the read bandwidth measured in the same run, and the int8 path's error
(relative L2 against the float32 path's output, itself the float32 matmul with the file's exact
weights).

    .venv/bin/python bench/int8_activations.py [--rows 1,2,4,8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import torch  # noqa: E402

from ceilings import best_of, memory_bandwidth  # noqa: E402
from kernels import cpu_isa, quant_gemv  # noqa: E402
from kernels.cpu_build import load_cpu_extension, unavailable  # noqa: E402
from services.common.model_path import default_model_path  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "int8_activation_probe.cpp")


def step_weights(ckpt) -> list[quant_gemv.QuantWeight]:
    """The weights one decode step reads, in order: each layer's projections, then the tied head."""
    names = [n for n in ckpt.quantized if ".layers." in n]
    names.sort(key=lambda n: int(n.split(".layers.")[1].split(".")[0]))
    return [ckpt.quantized[n] for n in names] + [ckpt.quantized["model.embed_tokens.weight"]]


def inputs(weights, rows: int) -> dict[int, torch.Tensor]:
    """One random x [rows, K] per input width, scaled like post-norm activations."""
    gen = torch.Generator().manual_seed(rows)
    return {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args(argv)
    fp32 = quant_gemv.load()
    if fp32 is None:
        print(f"int8 activations: not measured (quant_gemv not built: {unavailable.get('quant_gemv')})")
        return 0
    variants = {}  # name -> (x, weight) -> y
    if fp32.int8_activations():  # the worker's own path, named by its instructions
        variants[fp32.int8_path()] = lambda x, w: fp32.quant_linear(x, w.qs, w.d, w.m, w.code, None, True, True)
    probe = load_cpu_extension("int8_activation_probe", PROBE) if "avx_vnni" in cpu_isa.cpu_flags() else None
    if probe is not None:
        variants["probe avx-vnni"] = lambda x, w: probe.q8_linear(x, w.qs, w.d, w.m, w.code)
    if not variants:
        print("int8 activations: not measured (this build of quant_gemv has no int8 path: it needs AVX2)")
        return 0
    ckpt = load_checkpoint(default_model_path())
    weights = step_weights(ckpt)
    weight_bytes = sum(w.nbytes for w in weights)
    mem = memory_bandwidth()
    floor_ms = 1e3 * weight_bytes / (mem["read_gb_s"] * 1e9)
    out = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_isa.describe(), "machine": platform.processor(), "threads": torch.get_num_threads(),
           "weight_bytes": weight_bytes, "read_gb_s": mem["read_gb_s"], "rows": {}}
    print(f"{len(weights)} weights, {weight_bytes / 1e6:.1f} MB; read bandwidth {mem['read_gb_s']:.1f} GB/s "
          f"(weight-read floor {floor_ms:.2f} ms); {torch.get_num_threads()} threads; variants {list(variants)}")
    print(f"{'rows':>4} {'float32 ms':>10} " + " ".join(f"{v + ' ms':>10} {'ratio':>6} {'rel err':>8}" for v in variants)
          + f" {'fp32 bw':>8}")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = inputs(weights, rows)

        def run_fp32():
            return [fp32.quant_linear(xs[w.shape[1]], w.qs, w.d, w.m, w.code, None, True) for w in weights]

        def run_int8(variant):
            return [variants[variant](xs[w.shape[1]], w) for w in weights]

        with torch.inference_mode():
            ref = run_fp32()
            row = {"float32_ms": 1e3 * best_of(run_fp32, args.repeats)}
            for v in variants:
                got = run_int8(v)
                err = max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref))
                row[v] = {"ms": 1e3 * best_of(lambda: run_int8(v), args.repeats), "max_rel_err": err}
        row["float32_bw_fraction"] = floor_ms / row["float32_ms"]
        out["rows"][rows] = row
        print(f"{rows:>4} {row['float32_ms']:>10.2f} "
              + " ".join(f"{row[v]['ms']:>10.2f} {row[v]['ms'] / row['float32_ms']:>6.2f} {row[v]['max_rel_err']:>8.4f}"
                         for v in variants)
              + f" {row['float32_bw_fraction']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
