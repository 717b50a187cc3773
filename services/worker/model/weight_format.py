"""`--quantization`: the format the worker holds its linear weights in.

- auto: dense weights in --dtype, plus a GGUF file's own blocks for steps of at most
  --quant-max-rows rows (the cpu backend's attach: LlamaForCausalLM.use_quantized).
- none: dense weights only.
- gguf: every linear weight the file stores quantized (and the embedding / tied LM head)
  is held only as the file's blocks and computes on them at every batch size; weights the
  file stores as floats stay dense in --dtype.
- int8: every linear weight, from any checkpoint, quantized per output channel at load
  (symmetric, one float32 scale per row); the embedding and LM head stay dense.
- fp8: as int8, in float8_e4m3fn with one float32 scale per row (amax / 448; fp8_weights.py),
  on CPU and CUDA (the Triton W8A16 GEMM, kernels/triton/fp8_gemm.py).

The quantized-only layers (Linear.set_quant_only, QuantEmbedding) keep meta Parameters in
place of their weights, so `named_parameters()` keeps its names and shapes for every caller
(weight updates, LoRA targets) while nothing dense is resident.
"""
from __future__ import annotations

from types import ModuleType
from typing import Iterator

import torch
from torch import nn

from services.worker.model.fp8_weights import Fp8Weight
from services.worker.model.linear import Linear
from services.worker.model.quant_embedding import QuantEmbedding
from services.worker.model.quant_parts import QuantLike, QuantParts, fuse

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8")
QUANT_ONLY = ("gguf", "int8", "fp8")  # no dense copy of the quantized weights
CPU_ONLY = ("gguf", "int8")  # computed by the CPU kernels (kernels/quant_gemv.py)
REQUANTIZED = ("int8", "fp8")  # made at load from the float32 weights (requant_plan)
EMBED = "embed_tokens.weight"


def check_quantization(mode: str, device: str) -> None:
    """ValueError unless mode is a known --quantization usable on device."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode in CPU_ONLY and torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {mode} computes with the CPU kernels (kernels/quant_gemv.py); "
                         f"on {device} use --quantization fp8, auto or none")


def linear_sources(model: nn.Module) -> Iterator[tuple[Linear, list[str]]]:
    """Each dense linear of a Llama-family decoder with the HF names (without `model.`) it
    fuses, in row order: qkv ← q, k, v; gate_up ← gate, up; o, down; an untied LM head."""
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # MLA's projections (DeepSeek) stay dense
            yield attn.qkv_proj, [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
            yield attn.o_proj, [f"{p}self_attn.o_proj.weight"]
        if isinstance(getattr(mlp, "gate_up_proj", None), Linear):  # sparse MoE experts are not Linears
            yield mlp.gate_up_proj, [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up")]
            yield mlp.down_proj, [f"{p}mlp.down_proj.weight"]
    if not model.config.tie_word_embeddings:
        yield model.lm_head, ["lm_head.weight"]


def _strip(quantized: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in quantized.items()}


def file_blocks_plan(model: nn.Module, quantized: dict, only: set[str] | None = None) -> dict[str, QuantLike]:
    """--quantization gguf: module name → the blocks it will hold only, for every linear whose
    weights the file stores quantized and for the embedding (a tied LM head follows it:
    tie_quantized_head). quantized: HF name → QuantWeight. Parts in different formats fuse
    into QuantParts. only: restrict to these module names, each of which must get blocks
    (a weight update of a running model). ValueError saying what to do otherwise."""
    if not quantized:
        raise ValueError("--quantization gguf computes on a GGUF file's quantized blocks, and these weights have "
                         "none: give a quantized .gguf (radixmesh quantize makes one), or use --quantization int8 "
                         "or auto")
    q = _strip(quantized)
    names = module_names(model)
    plan: dict[str, QuantLike] = {}
    for linear, sources in linear_sources(model):
        parts = [q.get(n) for n in sources]
        if all(p is not None for p in parts):
            plan[names[id(linear)]] = fuse(parts)
        elif any(p is not None for p in parts):
            raise ValueError(f"--quantization gguf: {', '.join(sources)} are fused into one linear, but the file "
                             f"stores only some of them quantized; use --quantization auto for this file")
    if EMBED in q:
        plan["embed_tokens"] = q[EMBED]
    if only is not None:
        missing = sorted(only - set(plan))
        if missing:
            raise ValueError(f"--quantization gguf: the new weights have no quantized blocks for {missing[:4]} "
                             f"({len(missing)} modules held only as blocks)")
        plan = {k: v for k, v in plan.items() if k in only}
    return plan


def int8_plan(model: nn.Module, only: set[str] | None = None) -> dict[str, QuantLike]:
    """--quantization int8, from a model with its dense float32 weights loaded: module name →
    its per-channel int8 weight, for every linear of the layers (only: these names).

    The embedding and the LM head stay in the model's dtype, as int8 weight-only schemes leave
    them: measured on the default model (bench/quantization.py, kjv), int8 with the tied
    embedding/head quantized too is +1.23% perplexity against float32, and +0.94% without."""
    from kernels.quant_gemv import QuantWeight
    with torch.no_grad():
        return {name: QuantWeight.int8_per_channel(w.detach().float()) for name, w in _layer_weights(model, only)}


def fp8_plan(model: nn.Module, only: set[str] | None = None) -> dict[str, Fp8Weight]:
    """--quantization fp8, from a model with its dense float32 weights loaded: module name → its
    float8_e4m3fn weight with per-row scales (Fp8Weight.quantize), for every linear of the layers
    (only: these names), on the weights' device. The embedding and LM head stay dense, as int8's."""
    with torch.no_grad():
        return {name: Fp8Weight.quantize(w) for name, w in _layer_weights(model, only)}


def _layer_weights(model: nn.Module, only: set[str] | None) -> list[tuple[str, torch.Tensor]]:
    """(module name, dense weight) of every linear of the layers (an untied LM head excluded)."""
    names = module_names(model)
    return [(names[id(lin)], lin.weight) for lin, _ in linear_sources(model)
            if lin is not model.lm_head and (only is None or names[id(lin)] in only)]


def requant_plan(model: nn.Module, mode: str, only: set[str] | None = None) -> dict[str, QuantLike | Fp8Weight]:
    """The plan of a mode made at load from float32 weights (REQUANTIZED: int8_plan or fp8_plan),
    as a fresh runner (model_runner.build_model) and a weight update (weights/staging.py) make it."""
    if mode == "int8":
        return int8_plan(model, only)
    if mode == "fp8":
        return fp8_plan(model, only)
    raise ValueError(f"--quantization {mode} is not requantized from dense weights (only {', '.join(REQUANTIZED)})")


def apply_plan(model: nn.Module, plan: dict[str, QuantLike | Fp8Weight], kernel: ModuleType | None) -> None:
    """Make each planned module hold only its quantized weight (the embedding becomes a
    QuantEmbedding), then tie a tied LM head to the embedding's blocks."""
    for name, quant in plan.items():
        if name == "embed_tokens":
            model.embed_tokens = QuantEmbedding(quant, model.embed_tokens.weight.dtype)
        else:
            model.get_submodule(name).set_quant_only(quant, kernel)
    if model.lm_head is not None:
        tie_quantized_head(model, kernel)


def quant_only_modules(model: nn.Module) -> set[str]:
    """Names of the modules holding only quantized weights (the tied LM head excluded: it follows
    the embedding)."""
    found = {name for name, m in model.named_modules() if isinstance(m, QuantEmbedding)
             or (isinstance(m, Linear) and m.quant_only)}
    return found - {"lm_head"} if model.config.tie_word_embeddings else found


def module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def tie_quantized_head(model: nn.Module, kernel: ModuleType | None) -> None:
    """After tie_lm_head: a tied head over a quantized-only embedding runs on its blocks."""
    if model.config.tie_word_embeddings and isinstance(model.embed_tokens, QuantEmbedding):
        model.lm_head.set_quant_only(model.embed_tokens.quant, kernel)


def quant_only_refusal(model: nn.Module) -> str | None:
    """Why the one-call decode stack cannot run this model's weights, or None: it takes one
    QuantWeight of a kernel-known format per linear (a quantized-only embedding is looked up
    in Python and handed to it: LlamaForCausalLM.decode_step)."""
    mixed = [lin for lin in model.modules() if isinstance(lin, Linear) and isinstance(lin.quant, QuantParts)]
    if mixed:
        return f"{len(mixed)} linears fuse parts in different formats"
    fp8 = [lin for lin in model.modules() if isinstance(lin, Linear) and isinstance(lin.quant, Fp8Weight)]
    if fp8:
        return f"{len(fp8)} linears hold FP8 weights, which the stack's kernels do not read"
    return None


def quant_kernel(quantization: str):
    """The quantized-linear kernel for --quantization gguf/int8 (None otherwise). Imported here,
    not in the runner, which stays free of CPU modules."""
    if quantization not in ("gguf", "int8"):
        return None
    from kernels import quant_gemv
    return quant_gemv.load()
