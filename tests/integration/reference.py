"""Greedy reference continuations from transformers, and the comparison rule."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


def assert_matches(ours: list[int], ref: Reference, label: str) -> None:
    """Equal token for token, except after a true near-tie in the reference."""
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens, reference {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a != b:
            assert ref.top2_gaps[i] <= NEAR_TIE, (
                f"{label}: token {i} is {a}, reference {b}, and the reference's top-2 logit gap "
                f"{ref.top2_gaps[i]:.2e} is not a near-tie (<= {NEAR_TIE})")
            return
