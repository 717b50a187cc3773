"""Random PEFT LoRA adapters on disk, for tests and benchmarks.

Written as PEFT writes them (adapter_config.json, adapter_model.safetensors with
`base_model.model.<module>.lora_A.weight` names), so PEFT itself loads them
(`PeftModel.from_pretrained`). PEFT starts lora_B at zero, a no-op adapter; these are random in
both factors, sized so each module's delta is a visible fraction of its base output:
A ~ N(0, 1/in), B ~ N(0, std(W)^2 / r).
"""
from __future__ import annotations

import json
import math
import os

import torch
from torch import nn

from services.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from services.worker.lora.targets import MODULES

ALL7 = MODULES


def make_random_adapter(hf_model: nn.Module, out_dir: str, rank: int, alpha: float,
                        target_modules: tuple[str, ...] = ALL7, seed: int = 0, use_rslora: bool = False) -> str:
    """A random rank-`rank` LoRA adapter for every nn.Linear of `hf_model` (a transformers
    model) named one of `target_modules`, written to `out_dir` (created) → out_dir."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in hf_model.named_modules():
        if name.rpartition(".")[2] not in target_modules or not isinstance(module, nn.Linear):
            continue
        n_in, n_out = module.in_features, module.out_features
        std = float(module.weight.detach().float().std())
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / math.sqrt(n_in)  # [r, in]
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std / math.sqrt(rank)  # [out, r]
    if not tensors:
        raise ValueError(f"the model has no nn.Linear named any of {list(target_modules)}")
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": sorted(target_modules), "use_rslora": use_rslora, "lora_dropout": 0.0,
              "bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
              "base_model_name_or_path": getattr(getattr(hf_model, "config", None), "_name_or_path", "") or ""}
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
