"""Random tiny float32 models of every registry architecture, written by transformers, and the
helpers the architecture tests share: saving one, driving a ModelRunner over it step by step,
and transformers' greedy continuation.

Used by tests/unit/test_model_architectures*.py, tests/unit/test_gguf_architectures.py and
tests/integration/test_mesh_architectures.py.
"""
from __future__ import annotations

import json
import os

import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512)
PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # Phi3Config's defaults are outside the vocab
# Gemma 2: weights large enough (initializer_range) that both soft-caps bend the scores and logits;
# layer 0 slides (window 8), layer 1 attends to everything (transformers' default layer_types).
GEMMA2 = dict(num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
              attn_logit_softcapping=3.0, final_logit_softcapping=4.0, initializer_range=0.1)
MOE = dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# DeepSeek-V3: MLA (a q LoRA, latent 32 + RoPE 16 per token, interleaved RoPE rows), 8 routed experts in
# 4 groups of which 2 are eligible, one shared expert, layer 0 dense (first_k_dense_replace).
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                num_hidden_layers=3)

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
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                                         num_experts_per_tok=2, intermediate_size=32,
                                                         sliding_window=None)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {  # V2-Lite's q: one projection
        **DEEPSEEK, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
        "rope_interleave": False, "norm_topk_prob": False, "tie_word_embeddings": True}),
    # YaRN as the released V2/V3 configs set it, stretched 4x from 32 positions (the sequences run past 60),
    # mscale != mscale_all_dim so the cos/sin amplitude and the softmax scale both change
    "deepseek_v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DEEPSEEK, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
    # DeepSeek-V2: softmax routing, 3 experts from the best of 2 groups by its best score (so not always
    # the 3 best overall), scaled, never renormalised
    "deepseek_v2_group_limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **DEEPSEEK, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1, "num_experts_per_tok": 3,
        "n_shared_experts": 2}),
    "deepseek_v2_lite_greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {  # V2-Lite: no q LoRA, greedy
        **DEEPSEEK, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0}),
}

# One config per architecture beyond Llama/Qwen2, for the end-to-end checks (`radixmesh generate`,
# the mesh): each window (Phi-3 9, Mistral 8, Gemma 2's sliding layer 8) shorter than a 20-token prompt.
END_TO_END = ["qwen3_gqa_tied_wide_heads", "mistral_window", "gemma2", "phi3_window", "qwen3_moe"]

# Two batch shapes: rid → (length, prefill chunk lengths; the rest is decoded a token a step).
BATCHES = {
    "two": {"a": (70, [60]), "b": (23, [20])},
    "three_chunked": {"a": (45, [13, 13, 7]), "b": (30, [1, 16]), "c": (12, [5, 6])},
}


def build_tiny(name: str, **overrides):
    """The random transformers model CONFIGS[name] describes (seed 0), in eval mode."""
    import transformers
    config_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norm weights away from 1, so a dropped or misplaced norm would show
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            if pname.endswith("mlp.gate.weight"):  # a decisive router: top-k far from ties
                p.normal_(0.0, 0.5)
            if pname.endswith("e_score_correction_bias"):  # a bias that changes some choices
                p.normal_(0.0, 0.1)
    return model


def save_tiny(tmp_path, name: str, **overrides):
    """(directory, transformers model) of CONFIGS[name] saved as safetensors."""
    model = build_tiny(name, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path), model


def word_tokenizer(path: str, vocab_size: int) -> None:
    """tokenizer.json of a word-level vocabulary "t0" .. "t{vocab_size-1}": text "t5 t17" is ids [5, 17]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))


def save_for_generation(tmp_path, name: str):
    """save_tiny plus a word-level tokenizer, with no EOS id anywhere (config.json,
    generation_config.json): greedy generation runs to max_new_tokens, as transformers' loop does."""
    path, hf = save_tiny(tmp_path, name)
    for file in ("config.json", "generation_config.json"):
        full = os.path.join(path, file)
        if os.path.isfile(full):
            with open(full) as f:
                raw = json.load(f)
            raw.pop("eos_token_id", None)
            with open(full, "w") as f:
                json.dump(raw, f)
    word_tokenizer(path, BASE["vocab_size"])
    return path, hf


def greedy_continuation(hf, prompt: list[int], n_new: int) -> list[int]:
    """transformers' greedy next n_new tokens after prompt (full forward each step, no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def runner(path: str, page_size: int = 4, backend: str = "cpu", fused: bool = True):
    from services.worker.model_runner import ModelRunner
    return ModelRunner(WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=4 << 20, max_requests=4,
                                    attention_backend=backend, fused_ops=fused), load_checkpoint(path))


def sequences(batch: str) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    return {rid: torch.randint(0, 256, (n,), generator=g).tolist() for rid, (n, _) in BATCHES[batch].items()}


def pages(seqs: dict[str, list[int]], page_size: int) -> dict[str, list[int]]:
    n = -(-max(map(len, seqs.values())) // page_size) + 1  # distinct pages per request
    return {rid: list(range(i * n, (i + 1) * n)) for i, rid in enumerate(seqs)}


def logits_by_position(runner, seqs: dict[str, list[int]], chunks: dict[str, list[int]],
                       page_size: int) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Every request in every step, each fed its prefill chunks then one token a step
    → rid → [(position of a chunk's last token, logits row)]."""
    sp = SamplingParams(temperature=0.0)
    table = pages(seqs, page_size)
    runner.execute(StepPlan(0, [NewRequestSpec(rid, s, [], sp, 0) for rid, s in seqs.items()]))
    pos, todo, ours = {rid: 0 for rid in seqs}, {rid: list(c) for rid, c in chunks.items()}, {rid: [] for rid in seqs}
    step = 1
    while any(pos[r] < len(s) for r, s in seqs.items()):
        items = []
        for rid, s in seqs.items():
            if pos[rid] < len(s):
                n, first = (todo[rid].pop(0) if todo[rid] else 1), pos[rid] == 0
                items.append(StepItem(rid, s[pos[rid]:pos[rid] + n], pos[rid], table[rid] if first else [], first))
        logits, sampled = runner.compute_logits(StepPlan(step, [], items))
        for i, row in zip(sampled, logits):
            item = items[i]
            ours[item.rid].append((item.start_pos + len(item.input_ids) - 1, row))
            pos[item.rid] += len(item.input_ids)
        step += 1
    return ours


def assert_logits_match(runner, hf, seqs: dict[str, list[int]], chunks: dict[str, list[int]], page_size: int,
                        label: str) -> None:
    """Our logits at every chunk end equal transformers' on the whole sequence (float32)."""
    ours = logits_by_position(runner, seqs, chunks, page_size)
    with torch.no_grad():
        for rid, s in seqs.items():
            ref = hf(torch.tensor([s])).logits[0]  # [L, V]
            for p, row in ours[rid]:
                torch.testing.assert_close(row, ref[p], atol=2e-4, rtol=1e-4,
                                           msg=lambda m: f"{label} {rid} position {p}: {m}")
