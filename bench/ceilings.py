"""What this machine can do at best for the default model: the ceilings the
serving numbers are fractions of.

- memory bandwidth (a large tensor copy, and a read-only reduction);
- matmul throughput per dtype (one large GEMM);
- the model's linear-layers-only step time per batch size and dtype: the
  matmuls of one decode step (qkv, o, gate_up, down for every layer, then the
  LM head) and nothing else — no attention, norms, sampling or scheduling.
  Eager, oneDNN-prepacked, under torch.compile (freezing) when --compile is
  given, and on the GGUF file's own Q4_1/Q8_0 blocks (kernels/quant_gemv.py)
  for the small batches the worker runs that way (per linear from Python, and as one C++ call,
  which is what the worker's one-call decode step is compared with).

    .venv/bin/python bench/ceilings.py [--batch-sizes 1,16,64] [--dtypes float32,bfloat16,float16]
                                       [--compile] [--json bench/results/ceilings.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.common.model_path import default_model_path  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402
from services.worker.model.config import ModelConfig  # noqa: E402
from services.worker.model.linear import can_prepack, packed_linear, prepack  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def best_of(fn, repeats: int, warmup: int = 2) -> float:
    """Fastest wall time of `repeats` calls (seconds): the machine's noise only adds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(gib: float = 1.0) -> dict:
    n = int(gib * 2**30) // 4
    src, dst = torch.ones(n), torch.empty(n)
    copy_s = best_of(lambda: dst.copy_(src), 5)
    read_s = best_of(lambda: src.sum(), 5)
    return {"copy_gb_s": 2 * n * 4 / copy_s / 1e9, "read_gb_s": n * 4 / read_s / 1e9}


def matmul_tflops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_of(lambda: a @ b, 5) / 1e12


@dataclass
class LinearShapes:
    """(out_features, in_features) of each matmul of one decode step."""
    per_layer: list[tuple[int, int]]
    num_layers: int
    lm_head: tuple[int, int]

    @classmethod
    def of(cls, mc: ModelConfig) -> "LinearShapes":
        h = mc.hidden_size
        return cls([(mc.q_size + 2 * mc.kv_size, h), (h, mc.q_size), (2 * mc.intermediate_size, h),
                    (h, mc.intermediate_size)], mc.num_hidden_layers, (mc.vocab_size, h))

    @property
    def weight_params(self) -> int:
        return self.num_layers * sum(o * i for o, i in self.per_layer) + self.lm_head[0] * self.lm_head[1]

    def flops_per_token(self) -> int:
        return 2 * self.weight_params


class LinearOnly(torch.nn.Module):
    """The step's matmuls, chained so each consumes a tensor of the right width.
    packed: through oneDNN-prepacked weights, as the worker runs bfloat16/float16."""

    def __init__(self, shapes: LinearShapes, dtype: torch.dtype, packed: bool = False):
        super().__init__()
        self.packed = packed
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(o, i, dtype=dtype) * 0.02, requires_grad=False)
            for _ in range(shapes.num_layers) for o, i in shapes.per_layer)
        self.lm_head = torch.nn.Parameter(torch.randn(*shapes.lm_head, dtype=dtype) * 0.02, requires_grad=False)
        self.hidden = shapes.lm_head[1]
        self.widths = [w.shape[1] for w in self.weights]
        self.mats = [prepack(w) for w in self.weights] if packed else list(self.weights)
        self.head = prepack(self.lm_head) if packed else self.lm_head

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, w, None) if self.packed else F.linear(x, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, hidden]
        for j in range(0, len(self.mats), 4):
            qkv, o, gate_up, down = self.mats[j:j + 4]
            y = self._mm(x, qkv)[:, :self.widths[j + 1]].contiguous()
            x = self._mm(y, o)
            g = self._mm(x, gate_up)[:, :self.widths[j + 3]].contiguous()
            x = self._mm(g, down)
        return self._mm(x, self.head)


class GGUFLinearOnly(torch.nn.Module):
    """The same chain through the worker's own model, its linears on the checkpoint's
    quantized blocks (Q4_1 projections, Q8_0 head for the default model) as the worker runs
    small steps (LlamaForCausalLM.use_quantized, kernels/quant_gemv.py)."""

    def __init__(self, ckpt, dtype: torch.dtype, max_rows: int):
        super().__init__()
        from kernels import quant_gemv
        from services.worker.model_runner import build_model
        model = build_model(ckpt.config, ckpt.tensors, dtype, torch.device("cpu"))
        model.use_quantized(ckpt.quantized, max_rows, quant_gemv.load())
        from kernels import decode_stack
        model.use_decode_stack(decode_stack.load())
        self.stack = model.decode_stack  # its linears_only(B): the same matmuls as one C++ call
        self.mats = model.step_linears()
        self.head = model.lm_head
        self.hidden = ckpt.config.hidden_size
        self.widths = [m.in_features for m in self.mats]

    def _mm(self, x: torch.Tensor, linear) -> torch.Tensor:
        return linear(x)

    forward = LinearOnly.forward


_gguf_models: dict[torch.dtype, GGUFLinearOnly] = {}  # one model build per activation dtype


def linear_step_seconds(shapes: LinearShapes, dtype: torch.dtype, batch: int, mode: str, ckpt=None) -> float:
    """mode: eager (F.linear), packed (oneDNN prepacked weights), compile (torch.compile, freezing)
    or gguf (the checkpoint's quantized blocks; activations in dtype, one Python call per linear)
    or gguf-1call (the same matmuls in float32 as one C++ call: DecodeStack.linears_only, the
    floor of the worker's one-call decode step)."""
    if mode in ("gguf", "gguf-1call"):
        if dtype not in _gguf_models:
            _gguf_models[dtype] = GGUFLinearOnly(ckpt, dtype, max_rows=64)
        model = _gguf_models[dtype]
        if mode == "gguf-1call":
            if model.stack is None:
                raise RuntimeError("the decode-stack kernel is not built")
            return best_of(lambda: model.stack.linears_only(batch), 10, warmup=3)
    else:
        model = LinearOnly(shapes, dtype, packed=mode == "packed").eval()
    x = torch.randn(batch, model.hidden, dtype=dtype)
    with torch.inference_mode():
        fn = model
        if mode == "compile":
            import torch._inductor.config as inductor_config
            inductor_config.freezing = True
            fn = torch.compile(model, dynamic=False)
        return best_of(lambda: fn(x), 10, warmup=3)


def machine_limits(batch: int = 64, dtype_name: str = "bfloat16") -> dict:
    """The two limits serving numbers are fractions of, measured now (seconds, in-process):
    the linear-only step at `batch` rows in `dtype_name` through prepacked weights where the CPU
    prepacks that dtype (else eager), as tokens/s; and the batch-1 floor, the step's weight bytes
    (the checkpoint's quantized blocks where it has them: what the worker reads at batch 1) over the
    measured read bandwidth."""
    torch.manual_seed(0)
    torch.set_flush_denormal(True)  # as main(): chained random matmuls must not run in denormals
    ckpt = load_checkpoint(default_model_path())
    shapes, dtype = LinearShapes.of(ckpt.config), DTYPES[dtype_name]
    mode = "packed" if can_prepack(torch.empty(1, dtype=dtype)) else "eager"
    step_s = linear_step_seconds(shapes, dtype, batch, mode, ckpt)
    mem = memory_bandwidth()
    weight_bytes = sum(q.nbytes for q in ckpt.quantized.values()) if ckpt.quantized \
        else shapes.weight_params * dtype.itemsize
    return {"linear_only": {"dtype": dtype_name, "mode": mode, "batch": batch, "step_ms": 1e3 * step_s,
                            "tok_s": batch / step_s},
            "memory": mem, "batch1_weight_bytes": weight_bytes,
            "batch1_floor_ms": 1e3 * weight_bytes / (mem["read_gb_s"] * 1e9),
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--compile", action="store_true", help="also time the linear-only step under torch.compile")
    p.add_argument("--gguf-batch-sizes", default="1,2,4,8",
                   help="batch sizes for the step on the file's own quantized weights (with the float32 and "
                        "bfloat16 activations asked for by --dtypes; empty: skip)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    # Chained random matmuls shrink activations into denormals, which x86 computes
    # ~10x slower; real activations don't live there, so flush them as the worker does.
    torch.set_flush_denormal(True)
    ckpt = load_checkpoint(default_model_path())
    mc = ckpt.config
    shapes = LinearShapes.of(mc)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                 "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "model": mc.name,
                 "weight_params_in_step": shapes.weight_params, "flops_per_token": shapes.flops_per_token()}
    out["memory"] = memory_bandwidth()
    print(f"memory: copy {out['memory']['copy_gb_s']:.1f} GB/s, read {out['memory']['read_gb_s']:.1f} GB/s")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    gguf_batches = [int(b) for b in args.gguf_batch_sizes.split(",") if b] if ckpt.quantized else []
    if gguf_batches:  # the blocks' bytes as the kernel reads them, whatever the activations' dtype
        out["gguf_weight_bytes"] = gguf_bytes = sum(q.nbytes for q in ckpt.quantized.values())
    out["matmul_tflops"] = {}
    out["linear_step_ms"] = {}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        out["matmul_tflops"][name] = matmul_tflops(dtype)
        print(f"{name}: GEMM 2048^3 {out['matmul_tflops'][name]:.2f} TFLOP/s")
        modes = ["eager"] + (["packed"] if can_prepack(torch.empty(1, dtype=dtype)) else [])
        runs = [(mode, b) for mode in modes + (["compile"] if args.compile else []) for b in batches]
        if ckpt.quantized and name in ("float32", "bfloat16"):
            runs += [("gguf", b) for b in gguf_batches]
        if ckpt.quantized and name == "float32":  # the kernel's activations are float32 whatever the model's
            runs += [("gguf-1call", b) for b in gguf_batches]
        for mode, b in runs:
            ms = 1e3 * linear_step_seconds(shapes, dtype, b, mode, ckpt)
            out["linear_step_ms"][f"{name}/{mode}/{b}"] = ms
            weight_bytes = gguf_bytes if mode.startswith("gguf") else shapes.weight_params * dtype.itemsize
            bw_floor = weight_bytes / (out["memory"]["read_gb_s"] * 1e9) * 1e3
            print(f"  linear-only step {mode:10s} B={b:3d}: {ms:7.2f} ms  ({b / ms * 1e3:7.0f} tok/s; "
                  f"weight-read floor {bw_floor:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
