"""Greedy reference continuations from transformers, and the comparison rule."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch

# Computed references are kept here between runs: `make test` runs the reference tests twice
# (natively, then on the forced AVX2 baseline), and transformers' float32 decode of the
# default model is the slowest part of either run.
CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         ".build", "reference")

NEAR_TIE = 1e-3

PROMPTS_TEXT = [
    "What is the capital of France?",
    "Write a Python function that reverses a linked list.",
    "Explain the difference between TCP and UDP in two sentences.",
    "Translate to French: The weather is lovely today.",
    "List three prime numbers greater than 100.",
    "写一首关于秋天的短诗。",
    "What does this emoji mean? 🤖🚀✨",
    "Summarize the plot of Romeo and Juliet.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Give me a haiku about the ocean.",
    "How many legs does a spider have?",
    "Once upon a time, in a small village by the sea,",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "1, 2, 3, 5, 8, 13,",
    "SELECT name, age FROM users WHERE",
    # A long prompt so chunked prefill really chunks and pages really fill.
    " ".join(f"Item {i}: the value of item {i} is {i * i}." for i in range(40)) + " Therefore, item 7 is",
]


def prompt_ids(tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                              add_special_tokens=False) for p in PROMPTS_TEXT]
    return chats + [tokenizer.encode(p) for p in RAW_PROMPTS]


@dataclass
class Reference:
    tokens: list[int]
    top2_gaps: list[float]  # reference's logit(top1) - logit(top2) at each step


@torch.inference_mode()
def greedy_reference(hf_model, ids: list[int], max_new_tokens: int) -> Reference:
    """Plain greedy decoding with transformers' own KV cache, eos ignored."""
    out = hf_model(torch.tensor([ids]), use_cache=True)
    past, tokens, gaps = out.past_key_values, [], []
    logits = out.logits[0, -1]
    for _ in range(max_new_tokens):
        top = logits.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        tokens.append(int(top.indices[0]))
        out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return Reference(tokens, gaps)


def _cache_key(model_path: str, prompts: list[list[int]], max_new_tokens: int) -> str:
    """Everything the references depend on: the model file's bytes, the prompts, the length,
    and the versions of transformers and torch that computed them."""
    import transformers
    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(json.dumps([prompts, max_new_tokens, transformers.__version__, torch.__version__]).encode())
    return h.hexdigest()[:24]


def cached_references(model_path: str, prompts: list[list[int]], max_new_tokens: int,
                      hf_model: Callable[[], object]) -> list[Reference]:
    """greedy_reference for every prompt, computed once per cache key (hf_model() is only
    called, and the transformers model only loaded, when the key is new)."""
    path = os.path.join(CACHE_DIR, _cache_key(model_path, prompts, max_new_tokens) + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return [Reference(**r) for r in json.load(f)]
    model = hf_model()
    refs = [greedy_reference(model, ids, max_new_tokens) for ids in prompts]
    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump([dataclasses.asdict(r) for r in refs], f)
    os.replace(path + ".tmp", path)
    return refs


def assert_matches(ours: list[int], ref: Reference, label: str) -> None:
    """Equal token for token, except after a true near-tie in the reference."""
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens, reference {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a != b:
            assert ref.top2_gaps[i] <= NEAR_TIE, (
                f"{label}: token {i} is {a}, reference {b}, and the reference's top-2 logit gap "
                f"{ref.top2_gaps[i]:.2e} is not a near-tie (<= {NEAR_TIE})")
            return
