"""The "cpu" backend: torch attention with the C++ paged decode kernel, and the CPU worker's
tuning, which attach applies once to the process and the model:

- glibc keeping freed memory (cpu_tuning.py);
- the checkpoint's quantized blocks for steps of few rows (--quant-max-rows; kernels/quant_gemv.py),
  under --quantization auto (gguf/int8 models hold only their blocks: services/worker/model/weight_format.py);
- small pure-decode steps as one C++ call (--decode-stack; kernels/decode_stack.py), declined,
  op by op, for a model whose math the stack lacks (LlamaForCausalLM.decode_stack_refusal);
- that call's lead thread on its own CPU and at a higher priority (lead_cpu.py);
- the slower paths this CPU takes, logged once (fallbacks.py).
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable

import torch

from services.worker.attention.backend import Attached, DecodeStep
from services.worker.attention.batch_layout import BatchLayout
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.cpu_tuning import keep_freed_memory
from services.worker.fallbacks import warn_cpu_fallbacks
from services.worker.kv_pool import KVPool
from services.worker.lead_cpu import LeadCpu, LeadPriority
from services.worker.model.layer_attention import LayerAttention

if TYPE_CHECKING:
    from services.worker.config import WorkerConfig
    from services.worker.loader.checkpoint import Checkpoint
    from services.worker.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class CpuBackend:
    def __init__(self, scale: float, sliding_window: int | None = None):
        self.attention = TorchAttentionBackend(scale, native_decode=True, sliding_window=sliding_window)
        self.model: LlamaForCausalLM | None = None  # attach's
        self.quantized_weights = 0  # weights on the checkpoint's quantized blocks
        self.decode_stack = False  # small pure-decode steps as one C++ call
        self.int8_activations = False  # --quant-activations int8 in effect
        self.cpu_fallbacks: list[str] = []
        self.lead_cpu: LeadCpu | None = None  # --lead-cpu
        self.lead_priority: LeadPriority | None = None  # --lead-nice, with the decode stack

    def attach(self, model: LlamaForCausalLM, config: WorkerConfig, checkpoint: Checkpoint,
               prepacked: bool) -> Attached:
        if config.device == "cpu":
            keep_freed_memory()
        self.model = model
        self.int8_activations = _int8_activations(config)
        self.quantized_weights = _use_quantized(model, config, checkpoint, self.int8_activations)
        self.decode_stack = self.quantized_weights > 0 and _use_decode_stack(model, config, self.int8_activations)
        self.cpu_fallbacks = warn_cpu_fallbacks(config, prepacked)
        self.lead_cpu = LeadCpu(config.lead_cpu) if config.lead_cpu is not None else None
        self.lead_priority = LeadPriority(config.lead_nice) if self.decode_stack else None
        if self.lead_cpu and self.decode_stack:
            model.decode_stack.set_helper_cpus(sorted(self.lead_cpu.others))
        return Attached(self.quantized_weights, model.decode_stack_rows if self.decode_stack else 0)

    def one_call_step(self, step: DecodeStep, before_compute: Callable[[], None]) -> torch.Tensor | None:
        """Any step the runner offers (it keeps to one_call_rows, or its verify_max_rows when the
        step verifies a draft); the pool is in the model's dtype or FP8 (the stack widens it, and
        rounds the step's K/V to it as KVPool.write does)."""
        if not self.decode_stack:
            return None

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        token_ids, positions, rows, sampled = (i64(v) for v in (step.token_ids, step.positions, step.rows,
                                                                 step.sampled))
        before_compute()
        pinned = self.lead_cpu.leading() if self.lead_cpu else contextlib.nullcontext()
        with pinned, self.lead_priority.leading():
            return self.model.decode_step(token_ids, positions, step.page_table, rows, step.page_size,
                                          step.pool, sampled)

    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        self.attention.prepare(layout, pool)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: LayerAttention | None = None) -> torch.Tensor:
        return self.attention.forward(layer, q, k, v, variant)


def _use_quantized(model: LlamaForCausalLM, config: WorkerConfig, checkpoint: Checkpoint,
                   int8_activations: bool) -> int:
    """--quantization auto: small steps on the file's quantized blocks (Linear.set_quant) where
    they exist, the device is a CPU and the kernel builds → the number of weights that got them.
    none: 0. gguf / int8: the model was built holding only its blocks (weight_format.py) → the
    number of weights held so (and any others the file has blocks for, for small steps)."""
    from kernels import quant_gemv
    from services.worker.model.weight_format import QUANT_ONLY, quant_only_refusal
    if config.quantization == "none":
        return 0
    if config.quantization in QUANT_ONLY:
        refusal = quant_only_refusal(model)
        if refusal and config.decode_stack:
            log.info("one-call decode steps declined: %s; op by op", refusal)
        # counted as auto counts them (q, k, v: three); linears the file holds as floats stay dense
        return model.use_quantized(checkpoint.quantized, config.quant_max_rows, quant_gemv.load())
    if not (config.quant_max_rows and checkpoint.quantized and torch.device(config.device).type == "cpu"):
        return 0
    kernel = quant_gemv.load()
    if kernel is None:
        return 0
    if int8_activations:
        kernel = quant_gemv.Int8Activations(kernel)
    return model.use_quantized(checkpoint.quantized, config.quant_max_rows, kernel)


def _int8_activations(config: WorkerConfig) -> bool:
    """--quant-activations int8, where the build has an int8 path (AVX512-VNNI, else
    AVX2: kernels/cpu/int8_activations*.h) and --dtype float32, the exact mode, was not asked for;
    auto: the same, silently, and only under --quantization auto (the measured default on every
    CPU: docs/benchmarks.md, issue 41). On a CPU without fast bfloat16, --dtype auto runs the
    model in float32 for speed, not as the exact mode, so int8 activations still apply."""
    asked = config.quant_activations
    if asked == "float32" or (asked == "auto" and (config.quantization != "auto" or config.dtype == "float32")):
        return False
    from kernels import quant_gemv
    kernel = quant_gemv.load()
    if kernel is None:
        return False
    if not kernel.int8_activations():
        if asked == "int8":
            log.warning("--quant-activations int8: the quantized-linear kernel was built without an int8 path "
                        "(it needs AVX2 or AVX512-VNNI); the quantized steps keep float32 activations")
        return False
    return True  # int8 with --dtype float32 is refused by WorkerConfig


def _use_decode_stack(model: LlamaForCausalLM, config: WorkerConfig, int8_activations: bool) -> bool:
    """Pure-decode steps on the quantized blocks as one C++ call (LlamaForCausalLM.use_decode_stack),
    where that matches what the op-by-op path would run: fused ops and the native attention kernel.
    A model whose math the stack lacks declines it (LlamaForCausalLM.decode_stack_refusal)."""
    from services.worker.model.layer_ops import FusedCpuLayerOps
    if not (config.decode_stack and isinstance(model.ops, FusedCpuLayerOps)):
        return False
    refusal = model.decode_stack_refusal()
    if refusal is not None:
        log.info("one-call decode steps declined for %s (%s): op by op", model.config.name, refusal)
        return False
    from kernels import decode_stack
    if not model.use_decode_stack(decode_stack.load(), config.step_team_spin_us, config.quant_max_rows):
        return False
    model.decode_stack.set_int8_activations(int8_activations)  # as the op-by-op linears: both paths agree
    model.decode_stack.set_helper_nice(config.step_team_helper_nice)
    return True
