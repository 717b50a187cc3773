"""The HF loader refuses architectures the model code does not compute (it used to load any
config.json as Llama): each refusal names what it found and what is supported."""
from __future__ import annotations

import json

import pytest
import torch

from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.registry import ARCHITECTURES

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def save_tiny(tmp_path, config_cls: str, model_cls: str, **extra) -> str:
    import transformers
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    getattr(transformers, model_cls)(config).save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


@pytest.mark.parametrize("config_cls,model_cls,extra", [
    ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=2, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=16)),
])
def test_other_architectures_are_refused_by_name(tmp_path, config_cls, model_cls, extra):
    path = save_tiny(tmp_path, config_cls, model_cls, **extra)
    with pytest.raises(ValueError, match=f"architecture {model_cls}.* is not supported") as e:
        load_checkpoint(path)
    assert all(name in str(e.value) for name in ARCHITECTURES)


def test_qwen2_with_sliding_window_attention_is_refused(tmp_path):
    path = save_tiny(tmp_path, "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8,
                     max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        load_checkpoint(path)


@pytest.mark.parametrize("config_cls,model_cls,extra", [
    ("LlamaConfig", "LlamaForCausalLM", {}),
    ("Qwen2Config", "Qwen2ForCausalLM", {}),
    ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
])
def test_supported_architectures_load(tmp_path, config_cls, model_cls, extra):
    ckpt = load_checkpoint(save_tiny(tmp_path, config_cls, model_cls, **extra))
    c = ckpt.config
    assert c.hidden_size == 32 and c.attention_bias == (config_cls == "Qwen2Config")
    assert c.architecture == model_cls and c.qk_norm == (model_cls == "Qwen3ForCausalLM")
    assert c.sliding_window == extra.get("sliding_window") and c.head_dim == extra.get("head_dim", 16)


def edit_config(path: str, **changes) -> None:
    file = f"{path}/config.json"
    with open(file) as f:
        raw = json.load(f)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    with open(file, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize("changes,message", [
    (dict(architectures=None, model_type="gemma"), "model_type 'gemma' is not supported"),
    (dict(model_type="qwen2"), "disagree"),
    (dict(architectures=None, model_type=None), "names neither"),
])
def test_config_json_edits_are_checked_too(tmp_path, changes, message):
    path = save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)
