"""Which model class computes each Hugging Face `architectures` name.

Adding a model = its file (the class, or the ModelConfig fields it sets on the Llama decoder)
plus one line in ARCHITECTURES (docs/adding_a_model.md). Everything else is refused by name:
Gemma 1, Qwen2-MoE (shared experts), ... would load as Llama and compute wrong logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.deepseek import deepseek_model, deepseek_v2_fields, deepseek_v3_fields
from services.worker.model.gemma2 import Gemma2ForCausalLM, gemma2_fields
from services.worker.model.llama import LlamaForCausalLM
from services.worker.model.mistral import mistral_fields
from services.worker.model.mixtral import mixtral_fields, mixtral_hf_name, mixtral_model
from services.worker.model.phi3 import phi3_fields
from services.worker.model.qwen3 import qwen3_fields
from services.worker.model.qwen3_moe import qwen3_moe_fields, qwen3_moe_model


def _no_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {}


def _same_name(name: str) -> str:
    return name


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json's `model_type` for this architecture
    # Called with a ModelConfig by model_runner.build_model (a class, or a function composing one);
    # the runner calls LlamaForCausalLM's interface on the module (load_hf_tensors, forward,
    # prepack/quantized/decode-stack hooks, and decode_stack_refusal for what the one-call decode
    # stack does not compute).
    model_class: Callable[[ModelConfig], nn.Module]
    # config.json → ModelConfig fields beyond ModelConfig.from_hf_dict's; raises ValueError for
    # a variant the class does not compute.
    config_fields: Callable[[dict[str, Any]], dict[str, Any]] = _no_fields
    # A checkpoint tensor's name → the one load_hf_tensors and tensor parallelism read (Mixtral's
    # original block_sparse_moe names); the HF loader applies it to each tensor as it reads it,
    # before a worker group's rank cuts its slice.
    hf_name: Callable[[str], str] = _same_name


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", LlamaForCausalLM),
    "Qwen2ForCausalLM": Architecture("qwen2", LlamaForCausalLM),
    "Qwen3ForCausalLM": Architecture("qwen3", LlamaForCausalLM, qwen3_fields),
    "Phi3ForCausalLM": Architecture("phi3", LlamaForCausalLM, phi3_fields),
    "MistralForCausalLM": Architecture("mistral", LlamaForCausalLM, mistral_fields),
    "Gemma2ForCausalLM": Architecture("gemma2", Gemma2ForCausalLM, gemma2_fields),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", qwen3_moe_model, qwen3_moe_fields),
    "MixtralForCausalLM": Architecture("mixtral", mixtral_model, mixtral_fields, mixtral_hf_name),
    "DeepseekV2ForCausalLM": Architecture("deepseek_v2", deepseek_model, deepseek_v2_fields),
    "DeepseekV3ForCausalLM": Architecture("deepseek_v3", deepseek_model, deepseek_v3_fields),
}


def supported() -> str:
    """'LlamaForCausalLM (model_type 'llama'), ...' for error messages."""
    return ", ".join(f"{name} (model_type {a.model_type!r})" for name, a in ARCHITECTURES.items())


def by_model_type(model_type: str) -> str | None:
    """The architecture name of a config.json that names only its model_type."""
    return next((name for name, a in ARCHITECTURES.items() if a.model_type == model_type), None)


def model_class(config: ModelConfig) -> Callable[[ModelConfig], nn.Module]:
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise ValueError(f"architecture {config.architecture} is not supported (supported: {supported()})")
    return arch.model_class
