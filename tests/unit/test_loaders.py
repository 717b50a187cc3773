"""Checkpoint loaders: GGUF config + dequantization (against transformers and against the source
values of tiny synthetic files), the HF directory loader, and their error messages."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.loader.checkpoint import Checkpoint, load_checkpoint
from services.worker.loader.gguf_loader import (FastGGUFReader, llama3_factors,
                                                llama3_scaling_from_factors, load_gguf)
from services.worker.loader.hf_loader import load_hf_dir


# -- the default model ----------------------------------------------------------------------------
def test_default_gguf_config_matches_model_notes(checkpoint: Checkpoint) -> None:
    c = checkpoint.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.vocab_size) == (100000.0, 1e-5, 8192, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))


def test_default_gguf_tensor_inventory(checkpoint: Checkpoint) -> None:
    t = checkpoint.tensors
    assert len(t) == 272 and "lm_head.weight" not in t  # tied: 30 * 9 + embed + final norm
    c = checkpoint.config
    expected = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "model.layers.29.self_attn.q_proj.weight": (c.q_size, c.hidden_size),
        "model.layers.29.self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
        "model.layers.29.self_attn.o_proj.weight": (c.hidden_size, c.q_size),
        "model.layers.29.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "model.layers.29.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
    }
    for name, shape in expected.items():
        assert tuple(t[name].shape) == shape, name
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in t.values())


def test_dequantized_tensors_equal_transformers(checkpoint: Checkpoint, hf_model: torch.nn.Module) -> None:
    ref = hf_model.state_dict()
    assert set(checkpoint.tensors) == set(ref) - {"lm_head.weight"}
    for name, ours in checkpoint.tensors.items():  # all 272, q_proj/k_proj included
        assert ours.shape == ref[name].shape, name
        # max |diff| rather than assert_close, which is ~10x slower on 270 large tensors
        assert (ours - ref[name]).abs().max().item() <= 1e-6, name


def test_qk_permutation_is_undone(checkpoint: Checkpoint, hf_model: torch.nn.Module, model_path: str) -> None:
    # The file's own row order must differ from HF's, or the test above could not catch a missing un-permute.
    reader = FastGGUFReader(model_path)
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    file_order = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type))
    ref = hf_model.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(file_order, ref)
    assert torch.equal(checkpoint.tensors["model.layers.0.self_attn.k_proj.weight"], ref)


# -- tiny synthetic GGUF files --------------------------------------------------------------------
def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to Q/K (test-side, to check we undo it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(values: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if qtype == Q.F32:
        return values.astype(np.float32), qtype
    return gguf.quants.quantize(values, qtype), qtype


def _tiny_source(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, bias: bool,
                 output: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a one-layer model."""
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.post_attention_layernorm.weight": (hidden,),
        "model.layers.0.self_attn.q_proj.weight": (heads * hd, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv_heads * hd, hidden),
        "model.layers.0.self_attn.v_proj.weight": (kv_heads * hd, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, heads * hd),
        "model.layers.0.mlp.gate_proj.weight": (ffn, hidden),
        "model.layers.0.mlp.up_proj.weight": (ffn, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, ffn),
    }
    if bias:
        shapes.update({f"model.layers.0.self_attn.{p}_proj.bias": (n * hd,)
                       for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))})
    if output:
        shapes["lm_head.weight"] = (vocab, hidden)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    **{f"model.layers.0.mlp.{p}_proj.weight": f"blk.0.ffn_{p}.weight" for p in ("gate", "up", "down")},
    **{f"model.layers.0.self_attn.{p}_proj.{k}": f"blk.0.attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
}


def _write_gguf(path, arch: str, source: dict[str, np.ndarray], qtype: Q, heads: int, kv_heads: int,
                extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None, theta: float = 10000.0,
                extra_kv: dict[str, str | float] | None = None) -> None:
    """Write `source` as llama.cpp would: GGUF names, permuted Q/K for llama, 2-D weights in `qtype`."""
    hidden = source["model.embed_tokens.weight"].shape[1]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(source["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(3)
    for key, value in (extra_kv or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    for name, values in source.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            values = _llamacpp_permute(values, heads if "q_proj" in name else kv_heads)
        data, kind = _encode(values, qtype if values.ndim == 2 else Q.F32)  # llama.cpp keeps 1-D in F32
        w.add_tensor(_TO_GGUF[name], data, raw_dtype=kind)
    for name, (data, kind) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quant_tolerance(src: np.ndarray, qtype: Q) -> np.ndarray:
    """Per-element bound on |dequant(quant(x)) - x|: about one quantization step of x's 32-block."""
    if qtype == Q.F32:
        return np.zeros_like(src)
    if qtype == Q.F16:
        return np.abs(src) * 2.0**-11 + 1e-7
    if qtype == Q.BF16:
        return np.abs(src) * 2.0**-8 + 1e-30
    blocks = src.reshape(src.shape[0], -1, 32)
    amax, lo, hi = np.abs(blocks).max(-1), blocks.min(-1), blocks.max(-1)
    step = {Q.Q8_0: amax / 127, Q.Q4_0: amax / 8, Q.Q5_0: amax / 16,  # symmetric: clipping costs one step
            Q.Q4_1: (hi - lo) / 15, Q.Q5_1: (hi - lo) / 31}[qtype]
    return np.repeat(step * 1.01 + 1e-6, 32, axis=-1).reshape(src.shape)  # 1% for fp16 scales


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_quantization_round_trip(tmp_path, qtype: Q) -> None:
    source = _tiny_source(hidden=64, heads=2, kv_heads=1, ffn=96, vocab=40, bias=False, output=True)
    _write_gguf(tmp_path / "tiny.gguf", "llama", source, qtype, heads=2, kv_heads=1)
    ck = load_checkpoint(str(tmp_path / "tiny.gguf"))
    assert set(ck.tensors) == set(source)
    assert not ck.config.tie_word_embeddings and ck.config.eos_token_ids == (3,)
    for name, src in source.items():
        got = ck.tensors[name].numpy()
        assert got.shape == src.shape and got.dtype == np.float32, name
        err, tol = np.abs(got - src), _quant_tolerance(src, qtype if src.ndim == 2 else Q.F32)
        assert (err <= tol).all(), f"{name}: max excess {(err - tol).max()}"


def test_qwen2_keeps_qk_order_and_loads_biases(tmp_path) -> None:
    source = _tiny_source(hidden=64, heads=2, kv_heads=1, ffn=64, vocab=32, bias=True, output=False)
    _write_gguf(tmp_path / "qwen.gguf", "qwen2", source, Q.F32, heads=2, kv_heads=1)
    ck = load_gguf(str(tmp_path / "qwen.gguf"))
    assert ck.config.attention_bias and ck.config.tie_word_embeddings and ck.config.rms_norm_eps == 1e-6
    assert set(ck.tensors) == set(source)
    for name, src in source.items():
        np.testing.assert_array_equal(ck.tensors[name].numpy(), src, err_msg=name)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = llama3_factors(scaling, theta=500000.0, head_dim=64).astype(np.float32)
    source = _tiny_source(hidden=128, heads=2, kv_heads=1, ffn=64, vocab=32, bias=False, output=False)
    _write_gguf(tmp_path / "l31.gguf", "llama", source, Q.F32, heads=2, kv_heads=1, theta=500000.0,
                extra_tensors={"rope_freqs.weight": (factors, Q.F32)})
    got = load_gguf(str(tmp_path / "l31.gguf")).config.rope_scaling
    assert got is not None and got.keys() == scaling.keys() and got["rope_type"] == "llama3"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert got[key] == pytest.approx(scaling[key], rel=1e-4), key
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling_from_factors(np.linspace(1, 8, 32) ** 2, theta=500000.0, head_dim=64)


def test_linear_rope_scaling_keys(tmp_path) -> None:
    source = _tiny_source(hidden=64, heads=2, kv_heads=1, ffn=64, vocab=32, bias=False, output=False)
    _write_gguf(tmp_path / "lin.gguf", "llama", source, Q.F32, heads=2, kv_heads=1,
                extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert load_gguf(str(tmp_path / "lin.gguf")).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


# -- Hugging Face directories ---------------------------------------------------------------------
@pytest.mark.parametrize("tied,shard", [(False, False), (True, True)], ids=["untied", "tied-sharded"])
def test_hf_dir_round_trip(tmp_path, tied: bool, shard: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard

    ck = load_checkpoint(str(tmp_path))
    c = ck.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (128, 64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.rms_norm_eps, c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids) == (1e-6, tied, 1, (2,))
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(ck.tensors) == set(ref)
    for name, value in ref.items():
        assert ck.tensors[name].dtype == torch.float32
        torch.testing.assert_close(ck.tensors[name], value, rtol=0, atol=0, msg=name)


def test_hf_dir_casts_bf16_and_merges_generation_eos(tmp_path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    emb = torch.randn(8, 4).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": emb, "model.rotary_emb.inv_freq": torch.ones(2)},
              str(tmp_path / "model.safetensors"))
    ck = load_hf_dir(str(tmp_path))
    assert ck.config.eos_token_ids == (5, 6)
    assert list(ck.tensors) == ["model.embed_tokens.weight"]
    assert torch.equal(ck.tensors["model.embed_tokens.weight"], emb.float())


# -- errors ---------------------------------------------------------------------------------------
def test_missing_path_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))  # a directory, but not a model


def test_unsupported_files_are_value_errors(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="unsupported model file"):
        load_checkpoint(str(tmp_path / "weights.bin"))
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_checkpoint(str(tmp_path / "fake.gguf"))


def test_unsupported_architecture_and_quant_type(tmp_path) -> None:
    source = _tiny_source(hidden=64, heads=2, kv_heads=1, ffn=64, vocab=32, bias=False, output=False)
    _write_gguf(tmp_path / "gpt2.gguf", "gpt2", source, Q.F32, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_checkpoint(str(tmp_path / "gpt2.gguf"))
    # Q2_K: gguf can dequantize it but the quantized kernels have no such format (Q4_K, Q5_K and
    # Q6_K they have: kernels.quant_gemv.QTYPES), so it is refused by name.
    q2k = np.zeros((32, 84), dtype=np.uint8)  # 32 rows of one 256-element block
    _write_gguf(tmp_path / "q2k.gguf", "llama", source, Q.F32, heads=2, kv_heads=1,
                extra_tensors={"blk.0.extra.weight": (q2k, Q.Q2_K)})
    with pytest.raises(ValueError, match="Q2_K"):
        load_checkpoint(str(tmp_path / "q2k.gguf"))
