"""The GGUF loader on every registry architecture llama.cpp's format has: each tiny random model of
tiny_models.py written as its converter would (tiny_gguf.py, F32) loads to the same config and
weights as its HF directory, and our logits over the paged KV pool equal transformers'. Mistral
is `llama` with `llama.attention.sliding_window`; refusals name what they found."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from services.worker.loader import gguf_archs
from services.worker.loader.checkpoint import load_checkpoint
from tests.unit.tiny_gguf import GGUF_ARCH, write_gguf
from tests.unit.tiny_models import BASE, BATCHES, assert_logits_match, build_tiny, runner, save_tiny, sequences

# Every CONFIGS entry llama.cpp can express (gemma2_full_first_no_caps cannot: its gemma2 always
# soft-caps and slides layers 0, 2, ...), plus a Gemma 2 on the converter's default attention scale.
GGUF_CONFIGS = [("mistral_window", {}), ("mistral_no_window", {}), ("qwen3_gqa_tied_wide_heads", {}),
                ("qwen3_mha_untied", {}), ("qwen3_moe", {}), ("qwen3_moe_norm_topk_dense_layer", {}),
                ("phi3", {}), ("phi3_window", {}), ("gemma2", {}), ("gemma2", {"query_pre_attn_scalar": 16})]


def _both(tmp_path, name: str, overrides: dict, qtype=None):
    """(HF directory, GGUF file, transformers model) of one tiny config."""
    hf_dir, hf = save_tiny(tmp_path / "hf", name, **overrides)
    return hf_dir, write_gguf(hf, str(tmp_path / f"{name}.gguf"), qtype), hf


@pytest.mark.parametrize("name,overrides", GGUF_CONFIGS,
                         ids=[n + "".join(f"-{k}{v}" for k, v in o.items()) for n, o in GGUF_CONFIGS])
def test_gguf_loads_as_its_hf_directory_and_computes_transformers_logits(tmp_path, name, overrides):
    hf_dir, gguf_file, hf = _both(tmp_path, name, overrides)
    from_hf, from_gguf = load_checkpoint(hf_dir).config, load_checkpoint(gguf_file).config
    arch = gguf_archs.ARCHS[GGUF_ARCH[hf.config.model_type]]
    assert from_gguf.architecture == arch.architecture
    # Gemma 2's query_pre_attn_scalar may travel as a float32 attention.scale (None elsewhere)
    want_scalar = from_hf.query_pre_attn_scalar
    assert from_gguf.query_pre_attn_scalar == (want_scalar and pytest.approx(want_scalar, rel=1e-6, abs=0))
    assert from_gguf == dataclasses.replace(from_hf, name=from_gguf.name, architecture=arch.architecture,
                                            query_pre_attn_scalar=from_gguf.query_pre_attn_scalar)
    ours, ref = runner(gguf_file), runner(hf_dir)
    want = dict(ref.model.named_parameters())
    for pname, p in ours.model.named_parameters():  # Gemma's norms: (1 + w) - 1 rounds in float32
        torch.testing.assert_close(p, want[pname], rtol=0, atol=2.5e-7 if "norm" in pname else 0, msg=pname)
    chunks = {rid: c for rid, (_, c) in BATCHES["two"].items()}
    assert_logits_match(ours, hf, sequences("two"), chunks, 4, f"{name} from GGUF")


def test_mistral_window_is_read_from_llama_metadata(tmp_path):
    _, gguf_file, _ = _both(tmp_path, "mistral_window", {})
    c = load_checkpoint(gguf_file).config
    assert c.sliding_window == 8 and c.layer_window(0) == 8
    assert runner(gguf_file).model.decode_stack_refusal() == "sliding-window attention (window 8)"


def test_gemma2_27b_shape_scales_by_hidden_over_heads(tmp_path):
    """llama.cpp's rule for a Gemma 2 without attention.scale: head_dim, except the 27B (46 layers)."""
    hf = build_tiny("gemma2", num_hidden_layers=46, head_dim=32, query_pre_attn_scalar=16)  # hidden 64 / 4 heads
    path = write_gguf(hf, str(tmp_path / "g.gguf"))
    assert "gemma2.attention.scale" not in gguf.GGUFReader(path).fields
    c = load_checkpoint(path).config
    assert (c.head_dim, c.query_pre_attn_scalar) == (32, 16.0)
    assert c.layer_window(44) == 8 and c.layer_window(45) is None


def test_phi3_fused_tensors_split_into_quantized_rows(tmp_path):
    """Q8_0 attn_qkv / ffn_up split by rows: each HF weight gets its own blocks, equal to its values."""
    _, gguf_file, hf = _both(tmp_path, "phi3", {}, qtype=gguf.GGMLQuantizationType.Q8_0)
    ckpt = load_checkpoint(gguf_file)
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        name = f"model.layers.1.{part}.weight"
        q = ckpt.quantized[name]
        values = q.qs.view(torch.int8).float() * q.d.repeat_interleave(32, dim=1)
        assert torch.equal(values, ckpt.tensors[name]), name
        ref = hf.state_dict()["model.layers.1.self_attn.qkv_proj.weight" if "attn" in part else
                              "model.layers.1.mlp.gate_up_proj.weight"]
        assert ckpt.tensors[name].shape[1] == ref.shape[1]


def _write(path: str, arch: str, tensors: dict[str, np.ndarray], **kv) -> str:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    for key, value in kv.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


EMBD = {"token_embd.weight": np.zeros((BASE["vocab_size"], 32), np.float32)}


@pytest.mark.parametrize("arch,tensors,kv,message", [
    ("gemma3", {}, {}, "architecture 'gemma3' is not supported .*'gemma2', 'llama', 'phi3', 'qwen2', 'qwen3', "
                       "'qwen3moe'"),
    ("phi3", {"rope_factors_long.weight": np.ones(8, np.float32)}, {}, "LongRoPE"),
    ("phi3", {}, {"rope.dimension_count": 8}, "rope.dimension_count=8"),
    ("qwen3moe", {}, {"expert_count": 4}, "expert_used_count"),
    ("qwen3moe", {}, {"expert_count": 4, "expert_used_count": 5, "expert_feed_forward_length": 8},
     "expert_used_count=5"),
    ("qwen3moe", {}, {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 8,
                      "expert_gating_func": 2}, "expert_gating_func=2"),
    ("gemma2", {"output.weight": np.zeros((BASE["vocab_size"], 32), np.float32)}, {}, "untied LM head"),
    ("qwen3", {"blk.0.attn_gate.weight": np.zeros((32, 32), np.float32)}, {}, "'blk.0.attn_gate.weight' has no"),
])
def test_what_the_loader_does_not_compute_is_refused_by_name(tmp_path, arch, tensors, kv, message):
    path = _write(str(tmp_path / "m.gguf"), arch, {**EMBD, **tensors}, **kv)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)
