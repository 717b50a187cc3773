"""Perplexity through the worker's own paged prefill.

The corpus's tokens are cut into sliding windows (`windows`): each window runs as one request on
a ModelRunner, prefilled chunk by chunk as the scheduler would chunk it, so a chunk attends to the
K/V earlier chunks wrote to the paged pool (in the pool's dtype: an FP8 KV cache is read back
quantized) and its linears run on the worker's weights in whatever format they are. Every window
scores the tokens the previous one did not (the first scores all but its first token), so each
token after the corpus's first is scored once, with up to window - stride tokens of context before the
scored span (transformers' documented strided perplexity; with stride = window each window's first
token has no context and is not scored).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan


@dataclass(frozen=True)
class Window:
    begin: int  # the window's first token (index into the corpus's tokens)
    end: int  # one past its last
    scored_from: int  # the first token it scores; it scores tokens[scored_from:end]


@dataclass(frozen=True)
class PerplexityResult:
    tokens: int  # tokens scored
    nll_sum: float  # their summed negative log-likelihood (nats)
    seconds: float

    @property
    def nats_per_token(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "nats_per_token": self.nats_per_token, "perplexity": self.perplexity,
                "seconds": self.seconds}


def windows(n: int, window: int, stride: int) -> list[Window]:
    """Sliding windows over n tokens: `window` tokens each, starting every `stride`; together they
    score tokens 1..n-1 once each (but a window's first when stride = window)."""
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be in [1, --window={window}], got {stride}")
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}: raise --max-tokens or use a longer corpus")
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n:
            break
    return out


def window_nll(runner, tokens: list[int], w: Window, chunk: int, rid: str) -> tuple[float, int]:
    """Run window w as request `rid` on `runner` (a ModelRunner), chunk tokens per prefill step,
    and release it → (summed NLL of its scored tokens in nats, how many)."""
    ids = tokens[w.begin:w.end]
    pages = -(-len(ids) // runner.kv_spec.page_size)
    if pages > runner.kv_spec.num_pages:
        raise ValueError(f"a window of {len(ids)} tokens needs {pages} KV pages, the pool holds "
                         f"{runner.kv_spec.num_pages}: lower --window or raise --kv-cache-bytes")
    spec = NewRequestSpec(rid, list(ids), [], SamplingParams(max_new_tokens=1), seed=0)
    nll, count = 0.0, 0
    try:
        for c0 in range(0, len(ids), chunk):
            first = c0 == 0
            item = StepItem(rid, ids[c0:c0 + chunk], c0, list(range(pages)) if first else [],
                            reset_pages=first, sample=False)
            logits = runner.prefill_logits(StepPlan(0, [spec] if first else [], [item]))  # [t, V]
            # Row i predicts ids[c0 + i + 1], the corpus's token w.begin + c0 + i + 1.
            lo = max(w.scored_from - w.begin - 1 - c0, 0)
            hi = min(len(item.input_ids), len(ids) - 1 - c0)
            if hi <= lo:
                continue
            targets = torch.tensor(ids[c0 + lo + 1:c0 + hi + 1], dtype=torch.int64)
            logp = torch.log_softmax(logits[lo:hi].double(), dim=-1)  # [n, V]
            nll -= logp.gather(1, targets[:, None].to(logp.device)).sum().item()
            count += hi - lo
    finally:
        runner.execute(StepPlan(0, released_rids=[rid]))
    return nll, count


def perplexity(runner, tokens: list[int], window: int, stride: int, chunk: int) -> PerplexityResult:
    """The strided perplexity of `tokens` on `runner` (a ModelRunner)."""
    if chunk < 1:
        raise ValueError(f"--chunk must be >= 1, got {chunk}")
    t0 = time.perf_counter()
    nll, count = 0.0, 0
    for i, w in enumerate(windows(len(tokens), window, stride)):
        n, c = window_nll(runner, tokens, w, chunk, f"eval-ppl-{i}")
        nll, count = nll + n, count + c
    return PerplexityResult(count, nll, time.perf_counter() - t0)
