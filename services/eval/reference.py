"""The same strided perplexity computed by transformers (the harness's check, and the bench's)."""
from __future__ import annotations

import time

import torch

from services.eval.perplexity import PerplexityResult, windows


@torch.inference_mode()
def transformers_perplexity(hf_model, tokens: list[int], window: int, stride: int) -> PerplexityResult:
    """`hf_model` (an AutoModelForCausalLM) over the windows `perplexity` uses, each window in one
    forward without a cache → PerplexityResult over the same scored tokens."""
    t0 = time.perf_counter()
    nll, count = 0.0, 0
    for w in windows(len(tokens), window, stride):
        ids = torch.tensor([tokens[w.begin:w.end]])
        logits = hf_model(ids).logits[0]  # [n, V]
        lo = w.scored_from - w.begin - 1  # row i predicts ids[i + 1]
        logp = torch.log_softmax(logits[lo:-1].double(), dim=-1)
        nll -= logp.gather(1, ids[0, lo + 1:, None]).sum().item()
        count += ids.shape[1] - 1 - lo
    return PerplexityResult(count, nll, time.perf_counter() - t0)
