"""Random tiny Llama-family models written as HF safetensors directories: our
model's logits over the paged KV pool equal transformers' within fp32 tolerance."""
from __future__ import annotations

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model_runner import ModelRunner
from tests.unit.tiny_models import assert_logits_match, logits_by_position

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512)

CONFIGS = {
    "llama_gqa_tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_mha_untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False, rope_theta=500.0)),
    "llama3_rope_scaling": ("llama", dict(num_key_value_heads=1, rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
}


def _save_tiny(tmp_path, arch: str, extra: dict) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():  # random biases, so a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path), model


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("page_size,backend,fused", [(1, "cpu", True), (4, "cpu", True), (4, "torch", False)])
def test_logits_match_transformers(tmp_path, name, page_size, backend, fused):
    arch, extra = CONFIGS[name]
    path, hf = _save_tiny(tmp_path, arch, extra)
    ckpt = load_checkpoint(path)
    assert ckpt.config.attention_bias == (arch == "qwen2")
    runner = ModelRunner(WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=4 << 20, max_requests=4,
                                      attention_backend=backend, fused_ops=fused), ckpt)
    g = torch.Generator().manual_seed(1)
    seqs = {"a": torch.randint(0, 256, (70,), generator=g).tolist(),  # past the llama3 original context
            "b": torch.randint(0, 256, (23,), generator=g).tolist()}
    assert_logits_match(runner, hf, seqs, {"a": [60], "b": [20]}, page_size, name)  # prefill, then decode


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])  # head_dim 64: the AVX512-BF16 decode kernel
def test_bfloat16_native_decode_matches_gather_sdpa(tmp_path, heads, kv_heads):
    """bfloat16 serving path: the C++ decode kernel, which also writes each step's K/V into
    the pool, against the torch backend (index_copy + gather + SDPA) on the same weights.
    A dropped or misplaced KV write, or a wrong head mapping, moves logits by O(1)."""
    path, _ = _save_tiny(tmp_path, "llama", dict(hidden_size=64 * heads, num_attention_heads=heads,
                                                 num_key_value_heads=kv_heads, tie_word_embeddings=True))
    ckpt = load_checkpoint(path)
    g = torch.Generator().manual_seed(2)
    seqs = {r: torch.randint(0, 256, (n,), generator=g).tolist() for r, n in (("a", 50), ("b", 40), ("c", 21))}
    prefill = {"a": 30, "b": 7, "c": 20}
    runs = {}
    for backend in ("cpu", "torch"):
        runner = ModelRunner(WorkerConfig(dtype="bfloat16", page_size=16, kv_cache_bytes=4 << 20, max_requests=4,
                                          attention_backend=backend), ckpt)
        runs[backend] = logits_by_position(runner, seqs, {r: [n] for r, n in prefill.items()}, 16)
    for rid in seqs:
        for (p, ours), (_, ref) in zip(runs["cpu"][rid], runs["torch"][rid]):
            scale = ref.abs().max()
            assert (ours - ref).abs().max() <= 0.03 * scale, f"{rid} position {p}"
