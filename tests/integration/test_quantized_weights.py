"""--quantization on the real default model (SmolLM2-135M, Q4_1 linears, Q8_0 tied embedding).

gguf holds only the file's blocks, so in float32 math it computes with exactly the weights
the dense float32 model is built from: its greedy output is transformers' (the reference
rule: equal token for token up to a true near-tie), as --quantization auto's is. int8
requantizes those weights per channel: close, not exact, so it must agree for a good prefix.
"""
from __future__ import annotations

import statistics

import pytest

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.linear import Linear
from services.worker.model.quant_embedding import QuantEmbedding
from tests.integration.reference import Reference, assert_matches, cached_references, prompt_ids

pytestmark = pytest.mark.slow

REFERENCE_TOKENS = 64  # test_engine_reference's: the transformers references are cached for it
NEW_TOKENS = 32  # compared with the references' first 32 (measured: gguf equals auto on all 64)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_ids(tokenizer)


@pytest.fixture(scope="module")
def references(request, model_path, prompts):
    refs = cached_references(model_path, prompts, REFERENCE_TOKENS, lambda: request.getfixturevalue("hf_model"))
    return [Reference(r.tokens[:NEW_TOKENS], r.top2_gaps[:NEW_TOKENS]) for r in refs]


def _engine(checkpoint, tokenizer, quantization: str) -> Engine:
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=128 << 20, max_requests=32, quantization=quantization)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=32), checkpoint=checkpoint,
                  tokenizer=tokenizer)


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outputs = engine.generate_batch(prompts, GREEDY)  # one batch: decode steps of many rows too
    for out in outputs:
        assert out.error is None, out.error
    return [out.token_ids for out in outputs]


@pytest.fixture(scope="module")
def outputs(model_path, checkpoint, tokenizer, prompts):
    """quantization → (greedy tokens per prompt, the runner's weight_bytes)."""
    runs = {}
    gguf_checkpoint = load_checkpoint(model_path, quantization="gguf")  # no float32 copy of the blocks
    for mode, ckpt in (("auto", checkpoint), ("gguf", gguf_checkpoint), ("int8", checkpoint)):
        engine = _engine(ckpt, tokenizer, mode)
        try:
            runs[mode] = (_generate(engine, prompts), engine.runner.weight_bytes)
            if mode == "gguf":
                _assert_holds_no_dense_copy(engine.runner.model)
        finally:
            engine.shutdown()
    return runs


def _assert_holds_no_dense_copy(model) -> None:
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.weight.is_meta
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.quant_only and m.packed is None for m in linears)
    assert model.lm_head.quant is model.embed_tokens.quant  # tied: one set of blocks


def test_gguf_checkpoint_leaves_out_the_float_copies(model_path):
    ckpt = load_checkpoint(model_path, quantization="gguf")
    assert ckpt.quantized and not set(ckpt.quantized) & set(ckpt.tensors)
    assert "model.norm.weight" in ckpt.tensors  # float tensors still come dense


def test_gguf_float32_greedy_equals_transformers_and_auto(outputs, references):
    gguf, _ = outputs["gguf"]
    auto, _ = outputs["auto"]
    for i, (tokens, ref) in enumerate(zip(gguf, references)):
        assert_matches(tokens, ref, f"gguf prompt {i}")
    same = sum(a == b for a, b in zip(gguf, auto))
    assert same >= len(auto) - 1, f"only {same}/{len(auto)} prompts token-exact between gguf and auto"


def test_int8_agrees_for_a_good_prefix(outputs):
    int8, _ = outputs["int8"]
    auto, _ = outputs["auto"]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS) for x, y in zip(int8, auto)]
    # measured over 64 tokens: median first divergence 22 (from 2 to all 64)
    assert statistics.median(prefix) >= 8, f"int8's first divergence from float32 per prompt: {prefix}"


def test_weight_bytes_per_format(outputs):
    auto, gguf, int8 = (outputs[m][1] for m in ("auto", "gguf", "int8"))
    # auto float32: 135M float32 weights (~540 MB) plus the blocks; gguf: the file's blocks, ~0.11 GB.
    assert gguf < 0.3 * auto, (gguf, auto)
    # int8 keeps the tied embedding / LM head dense (bf16 and its prepacked copy, as auto does)
    assert gguf < int8 < 0.45 * auto, (gguf, int8, auto)
