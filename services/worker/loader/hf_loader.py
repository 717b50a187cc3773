"""Load a Hugging Face model directory (config.json + *.safetensors) into a `Checkpoint`."""
from __future__ import annotations

import dataclasses
import json
import os

import torch
from safetensors import safe_open

from services.common.model_path import model_id
from services.worker.loader.checkpoint import Checkpoint
from services.worker.model import registry
from services.worker.model.config import ModelConfig

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def load_hf_dir(path: str, part=None) -> Checkpoint:
    """Read `path/config.json` and every tensor of its safetensors shards as float32, under the
    name the model reads (the registry's hf_name: Mixtral's original expert names renamed), with
    `part` a worker group rank's part of each (load_checkpoint).

    Shards come from `model.safetensors.index.json` when present, otherwise every `*.safetensors`
    in the directory. Raises FileNotFoundError when config.json or the weights are missing and
    ValueError when the config is not an architecture of the model registry (see check_architecture).
    """
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model directory)")
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    arch = check_architecture(raw, config_file)
    try:
        config = ModelConfig.from_hf_dict(raw, name=model_id(path))
    except KeyError as e:
        raise ValueError(f"{config_file} lacks {e.args[0]!r}; is it a Llama-family decoder config?") from e
    try:
        fields = registry.ARCHITECTURES[arch].config_fields(raw)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from e
    config = dataclasses.replace(config, architecture=arch, **fields)
    config = _with_generation_eos(config, path)

    rank_part = part(config) if part is not None else None  # a worker group's rank: its part of each tensor
    hf_name = registry.ARCHITECTURES[arch].hf_name  # renamed before the rank's slice, which reads the names
    mtp = _mtp_prefixes(raw)
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(path):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer old checkpoints saved; the model recomputes it from the config
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # some exports save the tied head; one copy is enough
                if name.startswith(mtp):
                    continue  # the MTP layers: not the target's; the NEXTN drafter reads them (nextn_head.py)
                # to(float32) copies bf16/fp16 shards and keeps fp32 ones as loaded (no second copy).
                one = {hf_name(name): f.get_tensor(name).to(torch.float32).contiguous()}
                tensors.update(rank_part.take(one) if rank_part is not None else one)
    return Checkpoint(config=config, tensors=tensors, source=path, part=rank_part)


def check_architecture(raw: dict, where: str) -> str:
    """The architecture name config.json asks for, from the model registry (by `architectures`,
    `model_type` or both, consistently); ValueError for any other, or for something that changes
    the math (Qwen's use_sliding_window)."""
    archs, model_type = raw.get("architectures") or [], raw.get("model_type")
    known = registry.ARCHITECTURES
    if not archs and model_type is None:
        raise ValueError(f"{where} names neither `architectures` nor `model_type`; supported: {registry.supported()}")
    found = [a for a in archs if a not in known]
    if model_type is not None and registry.by_model_type(model_type) is None:
        found.append(f"model_type {model_type!r}")
    if found:
        raise ValueError(f"{where}: architecture {', '.join(found)} is not supported "
                         f"(supported: {registry.supported()})")
    types = {known[a].model_type for a in archs} | ({model_type} if model_type else set())
    if len(types) > 1:
        raise ValueError(f"{where}: architectures {archs} and model_type {model_type!r} disagree")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{where}: sliding-window attention (use_sliding_window) is not supported")
    return archs[0] if archs else registry.by_model_type(model_type)


def _mtp_prefixes(raw: dict) -> tuple[str, ...]:
    """The name prefixes of the multi-token-prediction layers config.json declares (DeepSeek's
    layout: num_nextn_predict_layers of them after the decoder's, model.layers.{L}.., L =
    num_hidden_layers); () when it declares none, so stray layers still fail the load."""
    first, n = raw.get("num_hidden_layers", 0), raw.get("num_nextn_predict_layers") or 0
    return tuple(f"model.layers.{i}." for i in range(first, first + n))


def _shards(path: str) -> list[str]:
    index_file = os.path.join(path, _INDEX)
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, _SINGLE)):
        files = [_SINGLE]
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (pytorch_model.bin is not supported)")
    missing = [n for n in files if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise FileNotFoundError(f"{path} is missing weight shards {missing}")
    return [os.path.join(path, n) for n in files]


def _with_generation_eos(config: ModelConfig, path: str) -> ModelConfig:
    # Chat models list extra stop ids only in generation_config.json (Llama-3.1: 128001/8/9).
    gen_file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_file):
        return config
    with open(gen_file, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
    return dataclasses.replace(config, eos_token_ids=merged)
