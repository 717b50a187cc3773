"""--quantization on tiny Llama models: a gguf runner computes exactly what an auto runner does
on the same blocks (with every step on them), holds no dense copy of them, and loads without
dequantizing them; an int8 runner stays close to float32; weight updates requantize (int8),
take a new GGUF's blocks (gguf) or are refused with the old weights serving."""
from __future__ import annotations

import gguf
import pytest

from tests.kernel_builds import built
import torch

from kernels import quant_gemv
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.linear import Linear
from services.worker.model.quant_embedding import QuantEmbedding
from services.worker.model_runner import ModelRunner
from services.worker.weights import WeightUpdateError
from tests.unit.test_weight_update import PAGE, hf_state, same, save_gguf, save_hf, tiny_hf, trace
from tests.unit.tiny_gguf import write_gguf

built(quant_gemv)


def runner(path: str, quantization: str, dtype: str = "float32", **kw) -> ModelRunner:
    config = WorkerConfig(dtype=dtype, page_size=PAGE, kv_cache_bytes=4 << 20, max_requests=4,
                          quantization=quantization, **kw)
    return ModelRunner(config, load_checkpoint(path, quantization))


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


def test_gguf_runner_equals_auto_on_the_same_blocks_with_no_dense_copy(tmp_path):
    path = save_gguf(tmp_path, "m", 0)  # Q8_0 everywhere, tied embedding
    ckpt = load_checkpoint(path, "gguf")
    assert ckpt.quantized and not set(ckpt.quantized) & set(ckpt.tensors)  # never dequantized whole
    r = runner(path, "gguf")
    # auto with every step (prefill chunks of 60 included) on the blocks, op by op: the same kernels
    auto = runner(path, "auto", quant_max_rows=64, decode_stack=False)
    assert same(trace(r), trace(auto))
    dense = runner(path, "none")
    assert all(m.quant is None for m in dense.model.modules() if isinstance(m, Linear))
    torch.testing.assert_close(trace(r), trace(dense), atol=2e-4, rtol=1e-4)  # float32 dense: same weights
    assert isinstance(r.model.embed_tokens, QuantEmbedding) and r.model.lm_head.quant is r.model.embed_tokens.quant
    assert all(m.quant_only for m in r.model.modules() if isinstance(m, Linear))
    assert r.weight_bytes < 0.4 * dense.weight_bytes
    assert r.model.decode_stack is not None and r.decode_stack  # small decode steps: one call, rows looked up here


def test_gguf_bfloat16_runner_stays_close_to_float32(tmp_path):
    path = save_gguf(tmp_path, "m", 0)
    assert max_rel_diff(trace(runner(path, "gguf", "bfloat16")), trace(runner(path, "gguf"))) < 0.05


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_int8_runner_is_close_to_float32_from_any_checkpoint(tmp_path, source):
    path = save_hf(tmp_path, "m", 0)[0] if source == "hf" else write_gguf(tiny_hf(0), str(tmp_path / "m.gguf"))
    r, dense = runner(path, "int8"), runner(path, "none")
    layers = [m for m in r.model.layers.modules() if isinstance(m, Linear)]
    assert layers and all(m.quant_only and m.quant.qtype == "int8" for m in layers)
    # the embedding and the (tied) head stay dense, as int8 weight-only schemes leave them
    assert not isinstance(r.model.embed_tokens, QuantEmbedding) and not r.model.lm_head.quant_only
    assert max_rel_diff(trace(r), trace(dense)) < 0.05
    layer_bytes = sum(m.weight.numel() * 4 for m in dense.model.layers.modules() if isinstance(m, Linear))
    assert r.weight_bytes < dense.weight_bytes - 0.7 * layer_bytes  # int8 + scales: ~1/4 of float32


def test_gguf_needs_a_quantized_file(tmp_path):
    path = save_hf(tmp_path, "m", 0)[0]
    with pytest.raises(ValueError, match="--quantization int8 or auto"):
        runner(path, "gguf")


def test_int8_weight_update_requantizes_like_a_fresh_runner(tmp_path):
    old, new = save_hf(tmp_path, "old", 0)[0], save_hf(tmp_path, "new", 1)
    r = runner(old, "int8")
    before = trace(r)
    r.update_weights_from_tensor(hf_state(new[1]))
    fresh = runner(new[0], "int8")
    after = trace(r)
    assert same(after, trace(fresh)) and not same(after, before)
    assert r.weight_bytes == fresh.weight_bytes


def test_gguf_weight_update_takes_the_new_files_blocks(tmp_path):
    old, new = save_gguf(tmp_path, "old", 0), save_gguf(tmp_path, "new", 1)
    r = runner(old, "gguf")
    before = trace(r)
    r.update_weights_from_disk(new)
    after = trace(r)
    assert same(after, trace(runner(new, "gguf"))) and not same(after, before)
    assert all(m.quant_only for m in r.model.modules() if isinstance(m, Linear))


def test_gguf_runner_refuses_dense_updates_and_keeps_serving(tmp_path):
    r = runner(save_gguf(tmp_path, "old", 0), "gguf")
    before = trace(r)
    _, hf = save_hf(tmp_path, "new", 1)
    with pytest.raises(WeightUpdateError, match="update it from a quantized GGUF file"):
        r.update_weights_from_tensor(hf_state(hf))
    assert r.weights_version == 0 and same(trace(r), before)
    f32 = write_gguf(tiny_hf(1), str(tmp_path / "f32.gguf"))  # a GGUF without quantized tensors
    with pytest.raises(WeightUpdateError, match="no quantized blocks|has none|these weights have none"):
        r.update_weights_from_disk(f32)
    assert r.weights_version == 0 and same(trace(r), before)


def test_mixed_quantized_and_float_fused_parts_are_refused(tmp_path):
    """A file with q/k quantized but v in F32 cannot hold qkv as blocks only."""
    hf = tiny_hf(0)
    path = write_gguf(hf, str(tmp_path / "m.gguf"), gguf.GGMLQuantizationType.Q8_0)
    ckpt = load_checkpoint(path, "auto")
    ckpt.quantized.pop("model.layers.0.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match="only some of them quantized"):
        ModelRunner(WorkerConfig(dtype="float32", page_size=PAGE, kv_cache_bytes=4 << 20, max_requests=4,
                                 quantization="gguf"), ckpt)


def test_lora_adapters_run_on_quantized_only_linears(tmp_path):
    """The adapter's deltas add to the blocks' output as they do to auto's on the same blocks."""
    from bench.common.random_adapter import make_random_adapter
    from tests.unit.lora_fixtures import lora_runner, run_together
    hf = tiny_hf(0)
    path = write_gguf(hf, str(tmp_path / "m.gguf"), gguf.GGMLQuantizationType.Q8_0)
    adapter = str(tmp_path / "adapter")
    make_random_adapter(hf, adapter, rank=8, alpha=16.0)
    requests = {"a": (list(range(3, 30)), "x"), "b": (list(range(40, 52)), "")}
    chunks = {"a": [20], "b": [12]}
    runs = [run_together(lora_runner(path, {"x": adapter}, **kw), requests, chunks)
            for kw in (dict(quantization="gguf"), dict(quant_max_rows=64, decode_stack=False))]
    for rid in requests:
        assert same([row for _, row in runs[0][rid]], [row for _, row in runs[1][rid]]), rid
    base = run_together(lora_runner(path, quantization="gguf"), {**requests, "a": (requests["a"][0], "")}, chunks)
    assert not same([row for _, row in base["a"]], [row for _, row in runs[0]["a"]])  # the adapter counts


def test_q4_k_m_file_runs_on_its_mixed_blocks(tmp_path):
    """A Q4_K_M mix (radixmesh quantize): the last layer's attn_v is Q6_K beside Q4_K q and k, so
    that qkv is held as parts; gguf equals auto on the same blocks and stays near dense float32."""
    from services.quantize.convert import convert_hf
    from services.worker.model.quant_parts import QuantParts
    src, _ = save_hf(tmp_path, "src", 0, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2)
    path = str(tmp_path / "m.gguf")
    convert_hf(src, path, "Q4_K_M", "Q8_0")
    r = runner(path, "gguf")
    qkv = [layer.self_attn.qkv_proj.quant for layer in r.model.layers]
    assert qkv[0].qtype == "Q4_K" and isinstance(qkv[1], QuantParts) and qkv[1].qtype == "Q4_K+Q6_K"
    auto = runner(path, "auto", quant_max_rows=64, decode_stack=False)
    assert same(trace(r), trace(auto))
    assert max_rel_diff(trace(r), trace(runner(path, "none"))) < 1e-4
