"""Random tiny Llama-family models written as HF safetensors directories: our
model's logits over the paged KV pool equal transformers' within fp32 tolerance."""
from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model_runner import ModelRunner

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
    ours = _logits_by_position(runner, seqs, {"a": 60, "b": 20}, page_size)
    with torch.no_grad():
        for rid, s in seqs.items():
            ref = hf(torch.tensor([s])).logits[0]  # [L, V]
            for p, row in ours[rid]:
                torch.testing.assert_close(row, ref[p], atol=2e-4, rtol=1e-4,
                                           msg=lambda m: f"{name} {rid} position {p}: {m}")


def _logits_by_position(runner: ModelRunner, seqs: dict[str, list[int]], prefill: dict[str, int],
                        page_size: int) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Prefill every sequence's first prefill[rid] tokens in one step, then decode the rest
    token by token, all requests in each step → rid → [(position, logits row)]."""
    sp = SamplingParams(temperature=0.0)
    n_pages = -(-max(map(len, seqs.values())) // page_size) + 1  # distinct pages per request
    pages_per = {rid: list(range(i * n_pages, (i + 1) * n_pages)) for i, rid in enumerate(seqs)}
    plan = StepPlan(1, [NewRequestSpec(rid, s[:prefill[rid]], [], sp, 0) for rid, s in seqs.items()],
                    [StepItem(rid, s[:prefill[rid]], 0, pages_per[rid], True, True) for rid, s in seqs.items()])
    runner.execute(StepPlan(0, plan.new_requests))  # admit only; compute_logits runs the items
    ours = {rid: [] for rid in seqs}
    logits, _ = runner.compute_logits(plan)
    for rid, row in zip(seqs, logits):
        ours[rid].append((prefill[rid] - 1, row))
    pos = dict(prefill)
    step = 2
    while any(pos[r] < len(s) for r, s in seqs.items()):
        items = [StepItem(r, [s[pos[r]]], pos[r], []) for r, s in seqs.items() if pos[r] < len(s)]
        logits, _ = runner.compute_logits(StepPlan(step, [], items))
        for item, row in zip(items, logits):
            ours[item.rid].append((pos[item.rid], row))
            pos[item.rid] += 1
        step += 1
    return ours


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
        runs[backend] = _logits_by_position(runner, seqs, prefill, 16)
    for rid in seqs:
        for (p, ours), (_, ref) in zip(runs["cpu"][rid], runs["torch"][rid]):
            scale = ref.abs().max()
            assert (ours - ref).abs().max() <= 0.03 * scale, f"{rid} position {p}"
