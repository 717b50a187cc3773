"""Linear layers that can run on oneDNN-prepacked weights on CPU.

A plain `F.linear` in bfloat16 re-lays out the weight for the AMX/AVX-512
kernels on every call; prepacking does it once at load. It is what
`torch.compile` with freezing does for CPU linears, without compiling: the
same oneDNN kernel, called eagerly. Measured on this project's 2-core
Sapphire Rapids box (bench/ceilings.py): the decode step's linears take about
half the time at batch 1 and 0.7x at batch 64. The results are bit-identical
to `F.linear` and do not depend on the batch size (tests/unit/test_linear.py).

Only bfloat16 and float16 weights are packed: float32 goes through MKL's
sgemm, which prepacking does not beat at small batches. Whether this CPU can
pack a dtype is decided at run time (`prepack_refusal`): oneDNN's bf16 path
needs AVX-512 or AMX, its fp16 path AVX512-FP16 or AVX-NE-CONVERT (an AMD
EPYC has the first, not the second); elsewhere the layer runs `F.linear`.

A Linear can also hold the checkpoint's own quantized blocks (GGUF Q8_0/Q4_1,
kernels/quant_gemv.py). Calls with at most `quant_max_rows` rows then run on
them: at batch 1 a step is a read of the weights, and the blocks are 3.2x
(Q4_1) fewer bytes than bfloat16. The math stays float32 with the file's exact
weights, so this path is closer to the float32 reference than bfloat16 is.

With `--quantization gguf`, `int8` or `fp8` a Linear is quantized-only (`set_quant_only`): it holds
just its QuantWeight (or QuantParts, quant_parts.py; or an Fp8Weight, fp8_weights.py) and runs
every call on it at any batch size (kernels/quant_gemv.py: fused dot products for few rows,
dequantized tiles for many; FP8: the Triton GEMM on CUDA, a per-call widening on CPU);
`weight` is then a meta Parameter of the same shape and dtype, so no dense copy is resident.
Nothing may compute with it (beware: F.linear(cpu x, meta w) returns garbage, not an error):
every compute path checks `quant_only` first.

A Linear may carry a LoRA hook (`lora`, services/worker/lora/stacked.py) while adapters are
loaded: whichever path computed the base output, the hook adds the step's adapter deltas to it.
Without one the cost is a single attribute check.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_isa
from services.worker.model import quant_parts
from services.worker.model.fp8_weights import Fp8Weight

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def can_prepack(weight: torch.Tensor) -> bool:
    """True when oneDNN can prepack this weight here (CPU, half precision, oneDNN built in,
    the CPU has the instructions the dtype's packed kernel needs)."""
    return weight.device.type == "cpu" and prepack_refusal(weight.dtype) is None


@functools.cache
def prepack_refusal(dtype: torch.dtype) -> str | None:
    """Why `dtype` weights are not prepacked on this CPU, or None when they are: the CPU's
    flags first (kernels.cpu_isa), then one small packed matmul checked against F.linear,
    so a CPU or hypervisor that reports a flag it cannot honour falls back too."""
    if dtype not in PACKABLE_DTYPES:
        return f"{dtype} weights are not prepacked"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    missing = cpu_isa.prepack_missing(str(dtype).removeprefix("torch."))
    if missing:
        return missing
    try:
        weight = torch.randn(24, 32).to(dtype)
        x = torch.randn(3, 32).to(dtype)
        with torch.inference_mode():
            if torch.equal(packed_linear(x, prepack(weight), None), F.linear(x, weight)):
                return None
        return "oneDNN's packed matmul disagreed with F.linear on a probe"
    except RuntimeError as exc:
        return f"oneDNN refused: {str(exc).strip().splitlines()[0]}"


def prepack(weight: torch.Tensor, batch_hint: int | None = None) -> torch.Tensor:
    """weight [out, in] → an opaque oneDNN tensor for `packed_linear` (any batch size
    works; a hint picks the blocking for that size, None suits them all)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) → [..., out], in x's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear plus optional compute copies of the weight: a oneDNN-prepacked one,
    and the checkpoint's quantized blocks for calls of few rows.

    The plain `weight` stays the source of truth (loaders and weight updates
    write it); call `prepack()` again after changing it, and drop `quant`
    (`set_quant(None, 0)`) when the new weight no longer matches the file's.
    A quantized-only layer (set_quant_only) has no dense weight: its blocks are the truth.
    """

    packed: torch.Tensor | None = None
    quant = None  # a kernels.quant_gemv.QuantWeight, a quant_parts.QuantParts, or (quantized-only) an Fp8Weight
    quant_max_rows: int = 0
    _quant_kernel = None
    lora = None  # a LoRA hook, hook(x, y) → y plus each row's adapter delta (services/worker/lora)

    @property
    def quant_only(self) -> bool:
        """True when the quantized blocks are the only weights held (set_quant_only)."""
        return self.quant is not None and self.weight.is_meta

    def set_quant(self, quant, max_rows: int, kernel=None) -> None:
        """Run calls of at most max_rows rows on `quant` (a QuantWeight or QuantParts of this
        weight's shape) through `kernel` (kernels.quant_gemv.load()); None or 0 turns it off.
        A quantized-only layer keeps its blocks: set_quant_only replaces them."""
        if self.quant_only:
            raise ValueError("this linear holds only quantized weights (--quantization gguf/int8/fp8); "
                             "use set_quant_only to replace them")
        if quant is not None and quant.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {quant.shape} does not match {tuple(self.weight.shape)}")
        on = quant is not None and max_rows > 0 and kernel is not None
        self.quant, self.quant_max_rows, self._quant_kernel = (quant, max_rows, kernel) if on else (None, 0, None)

    def set_quant_only(self, quant, kernel) -> None:
        """Hold only `quant` (a QuantWeight or QuantParts of this weight's shape) and run every
        call on it through `kernel`; the dense weight is dropped (a meta Parameter remains).
        An Fp8Weight computes by itself on any device (kernel is ignored)."""
        if quant.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {quant.shape} does not match {tuple(self.weight.shape)}")
        if isinstance(quant, Fp8Weight):
            kernel = None
        elif kernel is None:
            raise ValueError("the CPU quantized-linear kernel is not built here: run with --quantization auto "
                             "or none (dense weights)")
        if not self.weight.is_meta:  # a meta weight (a tied head's embedding) stays shared
            self.weight = nn.Parameter(torch.empty(quant.shape, dtype=self.weight.dtype, device="meta"),
                                       requires_grad=False)
        self.packed = None
        self.quant, self.quant_max_rows, self._quant_kernel = quant, sys.maxsize, kernel

    def prepack(self) -> bool:
        """Prepack the dense weight (True when packed, or when quantized-only: nothing to pack)."""
        if self.quant_only:
            return True
        self.packed = prepack(self.weight) if can_prepack(self.weight) else None
        return self.packed is not None

    def unpack(self) -> None:
        self.packed = None

    @classmethod
    def sharing(cls, weight: nn.Parameter, bias: nn.Parameter | None = None) -> "Linear":
        """A Linear computing with an existing parameter (a tied LM head and its embedding):
        weight updates to one are updates to the other."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight, layer.bias = weight, bias
        return layer

    def _runs_quantized(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.quant is not None and x.shape[0] <= self.quant_max_rows

    def _quantized(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x [..., in] → [..., out] on the quantized blocks."""
        flat = x.reshape(-1, x.shape[-1])  # [T, in]
        if isinstance(self.quant, Fp8Weight):
            y = self.quant.linear(flat, self.bias, float_out=float_out)
        else:
            y = quant_parts.linear(flat, self.quant, self.bias, self._quant_kernel, float_out=float_out)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → float32 [T, out]; on the quantized blocks straight from their float32
        math, not rounded to x's dtype first."""
        if self._runs_quantized(x) or self.quant_only:
            return self._quantized(x, float_out=True)
        return self(x).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._runs_quantized(x) or self.quant_only:
            y = self._quantized(x)
        elif self.packed is not None:
            y = packed_linear(x, self.packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)
