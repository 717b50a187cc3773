"""Prompt logprobs and embeddings at the scheduler: what a request may reuse from the prefix
cache, and how the worker's entries reach the request's first output.

A cached prefix has no logits and no hidden states: a request asking for prompt logprobs from
position s reuses at most s - 1 cached tokens (position s - 1's logits score prompt[s]), one
asking for an embedding none (mean pooling needs every position; last pooling is kept to the
same rule for simplicity). SGLang limits its prefix match the same way; recomputing is what makes
a cached prompt's logprobs and embedding equal an uncached one's.
"""
from __future__ import annotations

from services.common.outputs import RequestOutput, TokenLogprob, TopToken
from services.scheduler.request import Request
from services.step.contract import Embedding, PromptLogprobs


def reuse_limit(req: Request) -> int | None:
    """The most prompt tokens req may take from the cache (None: no limit beyond the usual)."""
    sp = req.sampling
    if sp.embed and not req.extras_sent:
        return 0
    if sp.prompt_logprobs >= 0 and not req.extras_sent:
        return max(sp.logprob_start_len - 1, 0)
    return None


def collect(req: Request, entries: list[PromptLogprobs], embedding: Embedding | None) -> None:
    """Keep a step's entries for req; positions it has already (a recompute after a retraction) are skipped."""
    first = max(req.sampling.logprob_start_len, 1)
    for entry in entries:
        have = first + len(req.prompt_logprobs)
        skip = have - entry.start
        if skip < 0:
            raise RuntimeError(f"{req.rid}: prompt logprobs from position {entry.start}, position {have} expected")
        if not len(entry.top_token_ids) == len(entry.logprobs) * entry.top_k == len(entry.top_logprobs):
            raise RuntimeError(f"{req.rid}: {len(entry.logprobs)} prompt logprobs need top_k {entry.top_k} "
                               f"entries each")
        for i in range(skip, len(entry.logprobs)):
            top = [TopToken(t, v) for t, v in entry.top(i)]
            req.prompt_logprobs.append(TokenLogprob(req.prompt_ids[entry.start + i], entry.logprobs[i], top))
    if embedding is not None:
        req.embedding = embedding.values


def attach(req: Request, out: RequestOutput) -> None:
    """Put what req asked for on its first output (once)."""
    if req.extras_sent:
        return
    req.extras_sent = True
    sp = req.sampling
    if sp.prompt_logprobs >= 0:
        head = [TokenLogprob(req.prompt_ids[0], None)] if sp.logprob_start_len == 0 else []
        out.prompt_logprobs = head + req.prompt_logprobs
        req.prompt_logprobs = []
    if sp.embed:
        out.embedding, req.embedding = req.embedding, []
