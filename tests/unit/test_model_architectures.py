"""Architectures of the model registry beyond Llama/Qwen2 (Qwen3, Phi-3, Mistral, Gemma 2, Qwen3-MoE), each a random
tiny float32 model written by transformers: our logits over the paged KV pool (chunked prefill,
then decode, several requests a step) and our greedy tokens equal transformers'."""
from __future__ import annotations

import json

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.registry import ARCHITECTURES
from services.worker.model_runner import ModelRunner

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512)
PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # Phi3Config's defaults are outside the vocab
# Gemma 2: weights large enough (initializer_range) that both soft-caps bend the scores and logits;
# layer 0 slides (window 8), layer 1 attends to everything (transformers' default layer_types).
GEMMA2 = dict(num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
              attn_logit_softcapping=3.0, final_logit_softcapping=4.0, initializer_range=0.1)
MOE = dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# name → (transformers config class, model class, config fields)
CONFIGS = {
    "qwen3_gqa_tied_wide_heads": ("Qwen3Config", "Qwen3ForCausalLM",  # head_dim 32 != hidden / heads
                                  dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "qwen3_mha_untied": ("Qwen3Config", "Qwen3ForCausalLM",
                         dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=False, rope_theta=500.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, **PHI3_IDS)),
    "phi3_window": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4, sliding_window=9, **PHI3_IDS)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),
    "mistral_no_window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=None)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2),
    "gemma2_full_first_no_caps": ("Gemma2Config", "Gemma2ForCausalLM", {  # explicit layer_types, SDPA path
        **GEMMA2, "num_key_value_heads": 4, "layer_types": ["full_attention", "sliding_attention"],
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": 5}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
    "qwen3_moe_norm_topk_dense_layer": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {  # layer 1 a dense MLP
        **MOE, "num_experts": 4, "num_experts_per_tok": 3, "norm_topk_prob": True, "mlp_only_layers": [1],
        "tie_word_embeddings": True}),
}

# Two batch shapes: rid → (length, prefill chunk lengths; the rest is decoded a token a step).
BATCHES = {
    "two": {"a": (70, [60]), "b": (23, [20])},
    "three_chunked": {"a": (45, [13, 13, 7]), "b": (30, [1, 16]), "c": (12, [5, 6])},
}


def _save_tiny(tmp_path, name: str):
    import transformers
    config_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **extra})).eval()
    with torch.no_grad():  # norm weights away from 1, so a dropped or misplaced norm would show
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            if pname.endswith("mlp.gate.weight"):  # a decisive router: top-k far from ties
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path), model


def _runner(path: str, page_size: int, backend: str, fused: bool) -> ModelRunner:
    return ModelRunner(WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=4 << 20, max_requests=4,
                                    attention_backend=backend, fused_ops=fused), load_checkpoint(path))


def _sequences(batch: str) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    return {rid: torch.randint(0, 256, (n,), generator=g).tolist() for rid, (n, _) in BATCHES[batch].items()}


def _pages(seqs: dict[str, list[int]], page_size: int) -> dict[str, list[int]]:
    n = -(-max(map(len, seqs.values())) // page_size) + 1  # distinct pages per request
    return {rid: list(range(i * n, (i + 1) * n)) for i, rid in enumerate(seqs)}


def _logits_by_position(runner: ModelRunner, seqs: dict[str, list[int]], chunks: dict[str, list[int]],
                        page_size: int) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Every request in every step, each fed its prefill chunks then one token a step
    → rid → [(position of a chunk's last token, logits row)]."""
    sp = SamplingParams(temperature=0.0)
    pages = _pages(seqs, page_size)
    runner.execute(StepPlan(0, [NewRequestSpec(rid, s, [], sp, 0) for rid, s in seqs.items()]))
    pos, todo, ours = {rid: 0 for rid in seqs}, {rid: list(c) for rid, c in chunks.items()}, {rid: [] for rid in seqs}
    step = 1
    while any(pos[r] < len(s) for r, s in seqs.items()):
        items = []
        for rid, s in seqs.items():
            if pos[rid] < len(s):
                n, first = (todo[rid].pop(0) if todo[rid] else 1), pos[rid] == 0
                items.append(StepItem(rid, s[pos[rid]:pos[rid] + n], pos[rid], pages[rid] if first else [], first))
        logits, sampled = runner.compute_logits(StepPlan(step, [], items))
        for i, row in zip(sampled, logits):
            item = items[i]
            ours[item.rid].append((item.start_pos + len(item.input_ids) - 1, row))
            pos[item.rid] += len(item.input_ids)
        step += 1
    return ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("page_size,backend,fused", [(1, "cpu", True), (4, "cpu", True), (16, "torch", False)])
def test_logits_match_transformers(tmp_path, name, batch, page_size, backend, fused):
    path, hf = _save_tiny(tmp_path, name)
    runner = _runner(path, page_size, backend, fused)
    seqs = _sequences(batch)
    ours = _logits_by_position(runner, seqs, {rid: c for rid, (_, c) in BATCHES[batch].items()}, page_size)
    with torch.no_grad():
        for rid, s in seqs.items():
            ref = hf(torch.tensor([s])).logits[0]  # [L, V]
            for p, row in ours[rid]:
                torch.testing.assert_close(row, ref[p], atol=2e-4, rtol=1e-4,
                                           msg=lambda m: f"{name} {rid} position {p}: {m}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_match_transformers(tmp_path, name):
    """Prompts in chunks, then 24 greedy tokens each through execute (the sampler included)."""
    path, hf = _save_tiny(tmp_path, name)
    runner = _runner(path, 4, "cpu", True)
    prompts = {"a": (_sequences("two")["a"][:20], [7, 13]), "b": (_sequences("two")["b"][:5], [5])}
    sp, n_new = SamplingParams(temperature=0.0), 24
    pages = _pages({rid: p + [0] * n_new for rid, (p, _) in prompts.items()}, 4)
    new = [NewRequestSpec(rid, p, [], sp, 0) for rid, (p, _) in prompts.items()]
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    # prefill: chunk i of every request that has one, in step i
    for i in range(max(len(c) for _, c in prompts.values())):
        items = []
        for rid, (p, c) in prompts.items():
            if i < len(c):
                start = sum(c[:i])
                items.append(StepItem(rid, p[start:start + c[i]], start, pages[rid] if i == 0 else [], i == 0,
                                      sample=i == len(c) - 1))
        result = runner.execute(StepPlan(i + 1, new if i == 0 else [], items))
        for rid, tok in zip(result.rids, result.next_token_ids):
            out[rid].append(tok)
    step = 100
    while any(len(o) < n_new for o in out.values()):
        items = [StepItem(rid, [o[-1]], len(prompts[rid][0]) + len(o) - 1, []) for rid, o in out.items()
                 if len(o) < n_new]
        result = runner.execute(StepPlan(step, [], items))
        for rid, tok in zip(result.rids, result.next_token_ids):
            out[rid].append(tok)
        step += 1
    with torch.no_grad():
        for rid, (p, _) in prompts.items():
            ids = list(p)
            for _ in range(n_new):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            assert out[rid] == ids[len(p):], f"{name} {rid}"


@pytest.mark.parametrize("name,refusal", [("qwen3_mha_untied", "q/k RMSNorm"), ("mistral_window", "sliding-window"),
                                          ("phi3_window", "sliding-window"), ("phi3", None),
                                          ("gemma2", "Gemma 2"), ("qwen3_moe", "mixture-of-experts")])
def test_decode_stack_declines_what_it_does_not_compute(tmp_path, name, refusal):
    """The one-call decode stack computes plain Llama attention: a q/k norm or a window declines it
    before the kernel is looked at, and the runner keeps the op-by-op path."""
    path, _ = _save_tiny(tmp_path, name)
    runner = _runner(path, 4, "cpu", True)
    why = runner.model.decode_stack_refusal()
    assert (why is None) if refusal is None else (refusal in why)
    if refusal is not None:
        assert runner.model.use_decode_stack(kernel=object()) is False and runner.model.decode_stack is None
        assert runner.decode_stack is False


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
    path, _ = _save_tiny(tmp_path, "phi3")
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
