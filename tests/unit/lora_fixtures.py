"""Helpers the LoRA tests share: a tiny random Llama on disk, a runner serving adapters, steps
driven with several requests (each under its adapter), and PEFT's merged reference.

Random adapters on disk: bench.common.random_adapter.make_random_adapter (also for
engine- and mesh-level tests on the real model, `hf_model` in tests/conftest.py).
"""
from __future__ import annotations

import copy

import torch

from bench.common.random_adapter import make_random_adapter  # noqa: F401  (re-exported for tests)
from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
PAGE = 4


def save_tiny_llama(path, **overrides):
    """(directory, transformers model) of a random tiny Llama (seed 0; norms away from 1) saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def lora_runner(path: str, adapters: dict[str, str] | None = None, dtype: str = "float32", **config):
    """A ModelRunner over the checkpoint at path, loading adapters (name → directory)."""
    from services.worker.model_runner import ModelRunner
    lora_paths = tuple(f"{name}={d}" for name, d in (adapters or {}).items())
    base = dict(dtype=dtype, page_size=PAGE, kv_cache_bytes=8 << 20, max_requests=8)
    return ModelRunner(WorkerConfig(**{**base, **config, "lora_paths": lora_paths}), load_checkpoint(path))


def run_together(runner, requests: dict[str, tuple[list[int], str]], chunks: dict[str, list[int]],
                 first_step: int = 0) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Admit every request (rid → (tokens, adapter)), then run them all in each step: their prefill
    chunks, then one token a step → rid → [(position of a chunk's last token, logits row)]."""
    sp = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(first_step, [NewRequestSpec(rid, toks, [], sp, 0, adapter=adapter)
                                         for rid, (toks, adapter) in requests.items()]))
    n_pages = -(-max(len(t) for t, _ in requests.values()) // PAGE) + 1
    pages = {rid: list(range(i * n_pages, (i + 1) * n_pages)) for i, rid in enumerate(requests)}
    pos, todo, out = {r: 0 for r in requests}, {r: list(c) for r, c in chunks.items()}, {r: [] for r in requests}
    step = first_step + 1
    while any(pos[r] < len(t) for r, (t, _) in requests.items()):
        items = []
        for rid, (toks, _) in requests.items():
            if pos[rid] < len(toks):
                n, first = todo[rid].pop(0) if todo.get(rid) else 1, pos[rid] == 0
                items.append(StepItem(rid, toks[pos[rid]:pos[rid] + n], pos[rid], pages[rid] if first else [], first))
        logits, sampled = runner.compute_logits(StepPlan(step, [], items))
        for i, row in zip(sampled, logits):
            item = items[i]
            out[item.rid].append((item.start_pos + len(item.input_ids) - 1, row))
            pos[item.rid] += len(item.input_ids)
        step += 1
    runner.execute(StepPlan(step, [], [], released_rids=list(requests)))
    return out


def merged(hf, adapter_dir: str):
    """PEFT's reference: a copy of hf with the adapter loaded by PEFT and merged into its weights."""
    from peft import PeftModel
    return PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).merge_and_unload().eval()


def assert_matches(ours: list[tuple[int, torch.Tensor]], ref_model, tokens: list[int], label: str,
                   atol: float = 2e-5) -> None:
    """Our logits rows equal the reference model's at the same positions of the whole sequence."""
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0]  # [L, V]
    for p, row in ours:
        torch.testing.assert_close(row, ref[p], atol=atol, rtol=1e-4, msg=lambda m: f"{label} position {p}: {m}")
