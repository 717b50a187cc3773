"""One LoRA adapter read from a PEFT directory and checked against the base model.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]); the module's output gains `scaling · B (A x)`,
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Anything this worker would
not compute exactly as PEFT does is refused with an AdapterError naming the problem, before
any of it reaches the model. Only `safetensors` is read; peft is never imported.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch

from services.worker.lora.targets import ATTENTION_MODULES, MODULES, Target, TargetKey

ShardPair = Callable[[TargetKey, dict[str, torch.Tensor]], dict[str, torch.Tensor]]

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:]*")
# Config keys whose non-default value changes the math in ways this worker does not compute.
_REFUSED_FLAGS = {"use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
                  "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
                  "layer_replication": "layer_replication", "modules_to_save": "modules_to_save",
                  "rank_pattern": "per-module ranks (rank_pattern)",
                  "alpha_pattern": "per-module alphas (alpha_pattern)",
                  "target_parameters": "target_parameters", "megatron_config": "megatron_config"}


class AdapterError(ValueError):
    """An adapter this worker refuses (unreadable, unsupported, or not fitting the base model)."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    identity: str  # name@<12 hex of sha256(config, weights)>: the KV-cache namespace of its requests
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # the modules it has weights for, in MODULES order
    # (layer, module) → (A [r, in], scaling · B [out, r]), in the model's dtype, on the host.
    weights: dict[TargetKey, tuple[torch.Tensor, torch.Tensor]]


def check_name(name: str) -> str:
    """An adapter name: letters, digits and . _ - / : (no '@', which joins name and digest)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} must be non-empty letters, digits and . _ - / : "
                           "(starting with a letter or digit)")
    return name


def load_adapter(name: str, path: str, targets: dict[TargetKey, Target], max_rank: int,
                 dtype: torch.dtype, shard_pair: ShardPair | None = None) -> LoraAdapter:
    """Read and check the PEFT LoRA adapter in directory `path` for the model whose targets are
    `targets` (targets.model_targets) → its weights in `dtype`. Raises AdapterError.
    shard_pair: a tensor-parallel rank's part of each (layer, module)'s {"A", "B"}
    (services/worker/parallel/tensor_parallel.py), taken before the shapes are checked."""
    check_name(name)
    config_bytes, weights_bytes = _read(path, CONFIG_FILE), _read(path, WEIGHTS_FILE)
    config = _parse_config(config_bytes, path)
    rank, scaling, declared = _check_config(config, path, max_rank)
    tensors = _parse_tensors(weights_bytes, path)
    num_layers = 1 + max((layer for layer, _ in targets), default=-1)
    weights: dict[TargetKey, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, pair in sorted(tensors.items()):
        layer, module = key
        if module not in declared:
            raise AdapterError(f"{path}: weights for {module} in layer {layer}, which target_modules "
                               f"{sorted(declared)} does not list")
        if layer >= num_layers:
            raise AdapterError(f"{path}: weights for layer {layer}, but the base model has {num_layers} layers")
        if key not in targets:
            raise AdapterError(f"{path}: the base model has no dense {module} in layer {layer} "
                               "(a mixture-of-experts MLP's experts cannot take LoRA here)")
        if shard_pair is not None:
            pair = shard_pair(key, pair)
        weights[key] = _check_pair(key, pair, targets[key], rank, scaling, dtype, path)
    if not weights:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    digest = hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest()[:12]
    present = tuple(m for m in MODULES if any(mod == m for _, mod in weights))
    return LoraAdapter(name, os.path.abspath(path), f"{name}@{digest}", rank, scaling, present, weights)


def _read(path: str, file: str) -> bytes:
    full = os.path.join(path, file)
    if not os.path.isdir(path):
        raise AdapterError(f"LoRA adapter directory {path!r} does not exist")
    if not os.path.isfile(full):
        hint = " (only safetensors weights are read; re-save with safe_serialization=True)" \
            if file == WEIGHTS_FILE and os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterError(f"LoRA adapter {path!r} has no {file}{hint}")
    with open(full, "rb") as f:
        return f.read()


def _parse_config(raw: bytes, path: str) -> dict:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}/{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}/{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict, path: str, max_rank: int) -> tuple[int, float, set[str]]:
    """→ (rank, scaling, declared target modules), or AdapterError for what is not plain LoRA."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{path}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, what in _REFUSED_FLAGS.items():
        if config.get(key):
            raise AdapterError(f"{path}: {what} is not supported (adapter_config.json {key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scaling, _declared_modules(config.get("target_modules"), path)


def _declared_modules(declared, path: str) -> set[str]:
    if declared == "all-linear":  # PEFT: every linear but the LM head
        return set(MODULES)
    if isinstance(declared, str):
        declared = [declared] if declared in MODULES else None
    if not isinstance(declared, list) or not declared or not all(isinstance(m, str) for m in declared):
        raise AdapterError(f"{path}: target_modules must list module names from {list(MODULES)}, "
                           f"got {declared!r} (regular expressions are not supported)")
    unsupported = sorted(set(declared) - set(MODULES))
    if unsupported:
        raise AdapterError(f"{path}: target modules {unsupported} are not supported (only {list(MODULES)})")
    return set(declared)


def _parse_tensors(raw: bytes, path: str) -> dict[TargetKey, dict[str, torch.Tensor]]:
    """The weights file → (layer, module) → {"A": [r, in], "B": [out, r]}; both required."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors
    try:
        flat = load_safetensors(raw)
    except (SafetensorError, ValueError) as exc:
        raise AdapterError(f"{path}/{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
    pairs: dict[TargetKey, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in flat.items():
        m = _TENSOR.fullmatch(tensor_name)
        if m is None:
            raise AdapterError(f"{path}: tensor {tensor_name!r} is not a LoRA weight of a supported module "
                               f"({list(MODULES)} of a decoder layer)")
        layer, block, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in MODULES or (block == "self_attn") != (module in ATTENTION_MODULES):
            raise AdapterError(f"{path}: tensor {tensor_name!r} targets {block}.{module}, which is not supported "
                               f"(only {list(MODULES)})")
        pairs.setdefault((layer, module), {})[which] = tensor
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(f"{path}: layer {layer} {module} has no lora_{missing} weight")
    return pairs


def _check_pair(key: TargetKey, pair: dict[str, torch.Tensor], target: Target, rank: int, scaling: float,
                dtype: torch.dtype, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes against the base model's linear → (A [r, in], scaling · B [out, r]) in dtype."""
    a, b = pair["A"], pair["B"]
    layer, module = key
    want_a, want_b = (rank, target.in_features), (target.out_features, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise AdapterError(f"{path}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                           f"but the base model needs {want_a} and {want_b} (rank {rank}): an adapter for "
                           "another model?")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"{path}: layer {layer} {module} weights must be floating point, got {a.dtype}")
    return a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous()
