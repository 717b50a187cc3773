"""Prompt logprobs and embeddings: the rows a step computes beyond the sampled ones.

A request asking for prompt logprobs (sampling.prompt_logprobs = k >= 0) needs the logits of
every prompt position j from logprob_start_len - 1 on (position j's logits give prompt[j + 1]'s
logprob); one asking for an embedding (sampling.embed) needs the final norm's output of its last
prompt row (--pooling last) or of every prompt row (mean). Rows are taken from the items as they
run, so a prompt prefilled in several chunks gives the same values as one run whole: a chunk's
rows attend over the KV of the chunks before it. Only steps carrying such a request build a
`StepExtras`; every other step runs exactly as before (the runner checks one set per step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.step.contract import Embedding, PromptLogprobs

POOLINGS = ("last", "mean")


def wants_extras(sampling, output_ids: list[int]) -> bool:
    """Whether a request (as admitted) still needs prompt rows: prompt logprobs not yet sent (a
    request re-admitted with outputs sent them with its first token) or an embedding."""
    return (sampling.prompt_logprobs >= 0 and not output_ids) or sampling.embed


@dataclass
class _PromptRun:
    rid: str
    start: int  # prompt position of the first target
    rows: int  # how many of logit_rows are its, in order
    k: int


@dataclass
class _HiddenRun:
    req: object  # the runner's _Request: pool_sum / pool_count accumulate on it (mean pooling)
    rid: str
    rows: int
    final: bool  # the prompt's last row is among them: the embedding is complete


@dataclass
class StepExtras:
    logit_rows: list[int] = field(default_factory=list)  # flat token indices, after the sampled rows
    targets: list[int] = field(default_factory=list)  # the prompt token each logit row scores
    hidden_rows: list[int] = field(default_factory=list)  # flat token indices whose final hidden state pools
    done: list[str] = field(default_factory=list)  # rids whose prompt ends in this step
    _prompt: list[_PromptRun] = field(default_factory=list)
    _hidden: list[_HiddenRun] = field(default_factory=list)

    def finish(self, logits: torch.Tensor | None, hidden: torch.Tensor | None
               ) -> tuple[list[PromptLogprobs], list[Embedding]]:
        """logits [len(logit_rows), V] float32, hidden [len(hidden_rows), H] → the result's entries."""
        prompt: list[PromptLogprobs] = []
        if self._prompt:
            lp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(self.targets, dtype=torch.int64, device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
            k = max(run.k for run in self._prompt)
            top_v, top_i = (lp.topk(k, dim=-1) if k else (None, None))
            top_v, top_i = (top_v.tolist(), top_i.tolist()) if k else ([], [])
            at = 0
            for run in self._prompt:
                rows = range(at, at + run.rows)
                rows = rows if run.k else range(0)
                prompt.append(PromptLogprobs(run.rid, run.start, chosen[at:at + run.rows], run.k,
                                             [t for r in rows for t in top_i[r][:run.k]],
                                             [v for r in rows for v in top_v[r][:run.k]]))
                at += run.rows
        embeddings: list[Embedding] = []
        at = 0
        for run in self._hidden:
            rows = hidden[at:at + run.rows].float()
            at += run.rows
            req = run.req
            req.pool_sum = rows.sum(0) if req.pool_sum is None else req.pool_sum + rows.sum(0)
            req.pool_count += run.rows
            if run.final:
                pooled = req.pool_sum / req.pool_count
                embeddings.append(Embedding(run.rid, torch.nn.functional.normalize(pooled, dim=0).tolist()))
                req.pool_sum, req.pool_count = None, 0
        return prompt, embeddings


def plan_extras(items: list, reqs: list, pooling: str) -> StepExtras:
    """The extra rows of a step's items (flat token indices over the step's concatenated inputs)."""
    extras = StepExtras()
    offset = 0
    for item, req in zip(items, reqs):
        a, n = item.start_pos, len(item.input_ids)
        sp, prompt = req.sampling, req.prompt_ids
        p = len(prompt)
        if req.wants_extras and a < p:
            if sp.prompt_logprobs >= 0 and not req.output_ids:
                lo = max(a, max(sp.logprob_start_len, 1) - 1)
                hi = min(p - 1, a + n)  # the last prompt position's logits score the first output
                if hi > lo:
                    extras.logit_rows += range(offset + lo - a, offset + hi - a)
                    extras.targets += prompt[lo + 1:hi + 1]
                    extras._prompt.append(_PromptRun(item.rid, lo + 1, hi - lo, sp.prompt_logprobs))
            if sp.embed:
                final = a + n >= p
                lo = p - 1 if pooling == "last" else a
                if a + n > lo:
                    hi = min(p, a + n)
                    extras.hidden_rows += range(offset + lo - a, offset + hi - a)
                    extras._hidden.append(_HiddenRun(req, item.rid, hi - lo, final))
            if a + n >= p:
                extras.done.append(item.rid)
        offset += n
    return extras
