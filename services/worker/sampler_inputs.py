"""Turns the runner's per-request state into the sampler's batched inputs."""
from __future__ import annotations

from typing import Protocol

import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import SampledLogprobs
from services.worker.sampling import SamplingBatch, argmax_rows, pad_token_lists, sample, token_logprobs


class _SampledRequest(Protocol):
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: SamplingParams
    seed: int


def run_sampler(logits: torch.Tensor, reqs: list[_SampledRequest], eos_token_ids: tuple[int, ...]
                ) -> tuple[list[int], list[SampledLogprobs | None]]:
    """logits [B, V] for the rows of `reqs` → (next token ids, logprobs per row)."""
    params = [r.sampling for r in reqs]
    suppressed = [_suppressed(r, eos_token_ids) for r in reqs]
    if not any(suppressed) and all(map(_plain_greedy, params)):  # the common case: skip the batch tensors
        return argmax_rows(logits).tolist(), [None] * len(reqs)
    batch = SamplingBatch.build(
        params, [r.seed for r in reqs], [len(r.output_ids) for r in reqs],
        suppressed, logits.shape[-1], logits.device)
    prompt_tokens = output_tokens = None
    if batch.any_penalties:
        prompt_tokens = pad_token_lists([r.prompt_ids for r in reqs], logits.device)
        output_tokens = pad_token_lists([r.output_ids for r in reqs], logits.device)
    want = [p.top_logprobs if p.logprobs else -1 for p in params]
    out = sample(logits, batch, prompt_tokens, output_tokens, want)
    return out.next_token_ids.tolist(), token_logprobs(out, want)


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
