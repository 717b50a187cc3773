"""Turns the runner's per-request state into the sampler's batched inputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
                grammar: GrammarBackend | None = None, stats=None,
                to_host: bool = True) -> tuple[list[int] | torch.Tensor, list[SampledLogprobs | None]]:
    """logits [B, V] for the rows of `reqs` → (next token ids, logprobs per row). Rows with a
    grammar matcher sample only what their grammar allows next (`grammar`: the backend that
    fills and applies the batch's bitmask; `stats.masked_rows` counts them). to_host=False:
    the ids stay a [B] int64 tensor on the logits' device (no sync), for rows that want no
    logprobs (theirs come back None)."""
    params = [r.sampling for r in reqs]
    suppressed = [_suppressed(r, eos_token_ids) for r in reqs]
    mask = _grammar_mask(reqs, grammar, stats)
    if not any(suppressed) and all(map(_plain_greedy, params)):  # the common case: skip the batch tensors
        picked = argmax_rows(logits)  # [B]
        if mask is not None:
            mask.repick_greedy(logits, picked)
        return (picked.tolist() if to_host else picked), [None] * len(reqs)
    batch = SamplingBatch.build(
        params, [r.seed for r in reqs], [len(r.output_ids) for r in reqs],
        suppressed, logits.shape[-1], logits.device)
    prompt_tokens = output_tokens = None
    if batch.any_penalties:
        prompt_tokens = pad_token_lists([r.prompt_ids for r in reqs], logits.device)
        output_tokens = pad_token_lists([r.output_ids for r in reqs], logits.device)
    want = [p.top_logprobs if p.logprobs else -1 for p in params]
    out = sample(logits, batch, prompt_tokens, output_tokens, want, mask.apply if mask is not None else None)
    if not to_host:
        return out.next_token_ids, [None] * len(reqs)
    return out.next_token_ids.tolist(), token_logprobs(out, want)


@dataclass
class GrammarMask:
    """The batch's grammar bitmask, filled for the constrained `rows` (the others allow all)."""
    grammar: GrammarBackend
    bitmask: Any  # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set = token t allowed
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """logits [B, V]: -inf where the constrained rows' grammars forbid, in place."""
        self.grammar.apply_bitmask(logits, self.bitmask, self.rows)

    def repick_greedy(self, logits: torch.Tensor, picked: torch.Tensor) -> None:
        """picked [B]: the raw argmax of each row; the constrained rows whose argmax their grammar
        forbids get the argmax of their masked logits instead, in place. A row whose raw argmax
        is allowed needs no mask: masking only lowers other tokens. Only those rows are copied."""
        rows = torch.tensor(self.rows, dtype=torch.int64)  # on the host, as the bitmask
        tokens = picked.cpu()[rows]  # the step brings them to the host anyway
        words = self.bitmask[rows, tokens >> 5]  # [R] int32
        refused = rows[((words >> (tokens & 31)) & 1) == 0]
        if refused.numel():
            on_device = refused.to(logits.device)
            sub = logits[on_device]  # [n, V], a copy
            self.grammar.apply_bitmask(sub, self.bitmask[refused].contiguous(), list(range(len(refused))))
            picked[on_device] = argmax_rows(sub)


def _grammar_mask(reqs: list[_SampledRequest], grammar: GrammarBackend | None, stats) -> GrammarMask | None:
    """The grammar rows' bitmask, filled now (the matchers hold the state after the last token),
    or None when no row is constrained. A matcher that accepted its stop token is left out (its
    request ends; the token is dropped)."""
    rows = [b for b, r in enumerate(reqs) if r.matcher is not None and not r.matcher.terminated]
    if not rows or grammar is None:
        return None
    bitmask = grammar.new_bitmask(len(reqs))  # [B, ceil(V / 32)] int32
    for b in rows:
        reqs[b].matcher.fill_bitmask(bitmask, b)
    if stats is not None:
        stats.masked_rows += len(rows)
    return GrammarMask(grammar, bitmask, rows)


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
