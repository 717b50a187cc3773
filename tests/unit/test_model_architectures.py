"""Architectures of the model registry beyond Llama/Qwen2 (Qwen3, Phi-3, Mistral, Gemma 2, Qwen3-MoE,
Mixtral), each a random tiny float32 model written by transformers: our logits over the paged KV
pool (chunked prefill, then decode, several requests a step) and our greedy tokens equal
transformers'. The configs and helpers live in tests/unit/tiny_models.py."""
from __future__ import annotations

import json

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.registry import ARCHITECTURES
from tests.unit.tiny_models import (BASE, BATCHES, CONFIGS, assert_logits_match, greedy_continuation, pages,
                                    runner, save_tiny, sequences)

@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("page_size,backend,fused", [(1, "cpu", True), (4, "cpu", True), (16, "torch", False)])
def test_logits_match_transformers(tmp_path, name, batch, page_size, backend, fused):
    path, hf = save_tiny(tmp_path, name)
    chunks = {rid: c for rid, (_, c) in BATCHES[batch].items()}
    assert_logits_match(runner(path, page_size, backend, fused), hf, sequences(batch), chunks, page_size, name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_match_transformers(tmp_path, name):
    """Prompts in chunks, then 24 greedy tokens each through execute (the sampler included)."""
    path, hf = save_tiny(tmp_path, name)
    ours = runner(path, 4, "cpu", True)
    prompts = {"a": (sequences("two")["a"][:20], [7, 13]), "b": (sequences("two")["b"][:5], [5])}
    sp, n_new = SamplingParams(temperature=0.0), 24
    table = pages({rid: p + [0] * n_new for rid, (p, _) in prompts.items()}, 4)
    new = [NewRequestSpec(rid, p, [], sp, 0) for rid, (p, _) in prompts.items()]
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    # prefill: chunk i of every request that has one, in step i
    for i in range(max(len(c) for _, c in prompts.values())):
        items = []
        for rid, (p, c) in prompts.items():
            if i < len(c):
                start = sum(c[:i])
                items.append(StepItem(rid, p[start:start + c[i]], start, table[rid] if i == 0 else [], i == 0,
                                      sample=i == len(c) - 1))
        result = ours.execute(StepPlan(i + 1, new if i == 0 else [], items))
        for rid, tok in zip(result.rids, result.next_token_ids):
            out[rid].append(tok)
    step = 100
    while any(len(o) < n_new for o in out.values()):
        items = [StepItem(rid, [o[-1]], len(prompts[rid][0]) + len(o) - 1, []) for rid, o in out.items()
                 if len(o) < n_new]
        result = ours.execute(StepPlan(step, [], items))
        for rid, tok in zip(result.rids, result.next_token_ids):
            out[rid].append(tok)
        step += 1
    for rid, (p, _) in prompts.items():
        assert out[rid] == greedy_continuation(hf, p, n_new), f"{name} {rid}"


@pytest.mark.parametrize("name,refusal", [("qwen3_mha_untied", "q/k RMSNorm"), ("mistral_window", "sliding-window"),
                                          ("phi3_window", "sliding-window"), ("phi3", None),
                                          ("gemma2", "Gemma 2"), ("qwen3_moe", "mixture-of-experts"),
                                          ("mixtral", "mixture-of-experts"),
                                          ("deepseek_v3", "latent attention")])
def test_decode_stack_declines_what_it_does_not_compute(tmp_path, name, refusal):
    """The one-call decode stack computes plain Llama attention: a q/k norm or a window declines it
    before the kernel is looked at, and the runner keeps the op-by-op path."""
    path, _ = save_tiny(tmp_path, name)
    ours = runner(path, 4, "cpu", True)
    why = ours.model.decode_stack_refusal()
    assert (why is None) if refusal is None else (refusal in why)
    if refusal is not None:
        assert ours.model.use_decode_stack(kernel=object()) is False and ours.model.decode_stack is None
        assert ours.decode_stack is False


def test_sliding_window_declines_the_native_decode_kernel():
    assert TorchAttentionBackend(scale=1.0, native_decode=True, sliding_window=8).native is None


def test_unknown_architecture_is_refused_naming_the_registry(tmp_path):
    from transformers import GemmaConfig, GemmaForCausalLM
    torch.manual_seed(0)
    GemmaForCausalLM(GemmaConfig(**{**BASE, "num_key_value_heads": 2, "head_dim": 16})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="architecture GemmaForCausalLM.* is not supported") as e:
        load_checkpoint(str(tmp_path))
    for arch_name, arch in ARCHITECTURES.items():
        assert f"{arch_name} (model_type {arch.model_type!r})" in str(e.value)


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "'longrope'.*not supported"),
    ({"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "'su'.*not supported"),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_phi3_rope_variants_other_than_plain_are_refused(tmp_path, rope, message):
    path, _ = save_tiny(tmp_path, "phi3")
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = rope
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


@pytest.mark.parametrize("window,expected", [(8, 8), (511, 511), (512, None), (None, None)])
def test_a_window_covering_the_whole_context_is_no_window(tmp_path, window, expected):
    """max_position_embeddings is 512: a window that long never drops a key, so the model keeps
    the native decode kernel and the decode stack."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**{**BASE, "num_key_value_heads": 2, "sliding_window": window})
                       ).save_pretrained(tmp_path)
    assert load_checkpoint(str(tmp_path)).config.sliding_window == expected
