"""Turns the runner's per-request state into the sampler's batched inputs."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from services.common.grammar.backend import GrammarBackend, Matcher
from services.common.sampling_params import SamplingParams
from services.step.contract import SampledLogprobs
from services.worker.sampling import SamplingBatch, argmax_rows, pad_token_lists, sample, token_logprobs


class _SampledRequest(Protocol):
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: SamplingParams
    seed: int
    matcher: Matcher | None


def run_sampler(logits: torch.Tensor, reqs: list[_SampledRequest], eos_token_ids: tuple[int, ...],
                grammar: GrammarBackend | None = None, stats=None) -> tuple[list[int], list[SampledLogprobs | None]]:
    """logits [B, V] for the rows of `reqs` → (next token ids, logprobs per row). Rows with a
    grammar matcher sample only what their grammar allows next (`grammar`: the backend that
    fills and applies the batch's bitmask; `stats.masked_rows` counts them)."""
    params = [r.sampling for r in reqs]
    suppressed = [_suppressed(r, eos_token_ids) for r in reqs]
    mask = _grammar_mask(reqs, grammar, stats)
    if not any(suppressed) and all(map(_plain_greedy, params)):  # the common case: skip the batch tensors
        if mask is not None:
            logits = logits.clone()
            mask(logits)
        return argmax_rows(logits).tolist(), [None] * len(reqs)
    batch = SamplingBatch.build(
        params, [r.seed for r in reqs], [len(r.output_ids) for r in reqs],
        suppressed, logits.shape[-1], logits.device)
    prompt_tokens = output_tokens = None
    if batch.any_penalties:
        prompt_tokens = pad_token_lists([r.prompt_ids for r in reqs], logits.device)
        output_tokens = pad_token_lists([r.output_ids for r in reqs], logits.device)
    want = [p.top_logprobs if p.logprobs else -1 for p in params]
    out = sample(logits, batch, prompt_tokens, output_tokens, want, mask)
    return out.next_token_ids.tolist(), token_logprobs(out, want)


def _grammar_mask(reqs: list[_SampledRequest], grammar: GrammarBackend | None,
                  stats) -> Callable[[torch.Tensor], None] | None:
    """The grammar rows' bitmask, filled now (the matchers hold the state after the last token);
    returns what applies it to a logits tensor [B, V] in place, or None when no row is constrained.
    A matcher that accepted its stop token is left out (its request ends; the token is dropped)."""
    rows = [b for b, r in enumerate(reqs) if r.matcher is not None and not r.matcher.terminated]
    if not rows or grammar is None:
        return None
    bitmask = grammar.new_bitmask(len(reqs))  # [B, ceil(V / 32)] int32
    for b in rows:
        reqs[b].matcher.fill_bitmask(bitmask, b)
    if stats is not None:
        stats.masked_rows += len(rows)
    return lambda logits: grammar.apply_bitmask(logits, bitmask, rows)


def _suppressed(req: _SampledRequest, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Tokens that would end the request before min_new_tokens: banned this step."""
    sp = req.sampling
    if len(req.output_ids) >= sp.min_new_tokens:
        return []
    stops = list(sp.stop_token_ids)
    if not sp.ignore_eos:
        stops.extend(eos_token_ids)
    return stops


def _plain_greedy(sp: SamplingParams) -> bool:
    """Its token is the argmax of the raw logits (nothing banned aside): greedy, no penalty, no logprobs."""
    return (sp.is_greedy and not sp.logprobs and sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0
            and sp.presence_penalty == 0.0)
