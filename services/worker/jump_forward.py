"""Jump-forward on the worker: drafts from the grammar, checked by the model in one extend.

After a constrained request samples a token, its grammar may force what follows (after
`{"name": ` a schema may allow only `"name": "`); `draft()` returns those tokens. The scheduler
plans them as a verify item, `[last token, *draft]`: one model step computes their KV and the
logits at every position. `verify_rows()` gives the sampler one row per position, each masked
as the grammar would be after the draft's first i tokens, with the sample counter masked
decoding would use there; `accepted()` keeps the longest prefix of the draft the model's own
masked choice agrees with, plus its choice after it. So the output is token for token what
decoding one step at a time would give (greedy, and sampled: the noise is a function of the
seed and the position), while an agreeing draft of k tokens costs one model step instead of k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.grammar.backend import GrammarBackend, Matcher
from services.common.sampling_params import SamplingParams


def draft(matcher: Matcher, room: int) -> list[int]:
    """Tokens the grammar forces after the matcher's state, at most `room`."""
    return matcher.jump_forward_tokens()[:max(room, 0)] if room > 0 else []


class _FixedMask:
    """A matcher stand-in that writes a precomputed bitmask row (a draft position's)."""
    terminated = False

    def __init__(self, row: Any) -> None:
        self._row = row

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row].copy_(self._row)


@dataclass
class DraftRow:
    """The request as it stands after the draft's first tokens: a row for the sampler."""
    prompt_ids: list[int]
    output_ids: list[int]  # history + draft[:i]: penalties and the sample counter see the draft
    sampling: SamplingParams
    seed: int
    matcher: _FixedMask | None  # None: no grammar (a speculative draft)


def verify_rows(req, draft_ids: list[int], backend: GrammarBackend) -> list[DraftRow]:
    """One row per position of a verify item [last token, *draft_ids]: row i predicts the token
    after the draft's first i tokens. The matcher is walked over the draft and back."""
    m = req.matcher
    masks = backend.new_bitmask(len(draft_ids) + 1)  # [k + 1, ceil(V / 32)]
    walked = 0
    for i in range(len(draft_ids) + 1):
        m.fill_bitmask(masks, i)
        if i < len(draft_ids):
            if not m.accept_token(draft_ids[i]):
                break  # cannot happen for the grammar's own draft; the rows after it go unused
            walked += 1
    if walked:
        m.rollback(walked)
    return [DraftRow(req.prompt_ids, req.output_ids + draft_ids[:i], req.sampling, req.seed, _FixedMask(masks[i]))
            for i in range(len(draft_ids) + 1)]


def plain_verify_rows(req, draft_ids: list[int]) -> list[DraftRow]:
    """verify_rows for a request without a grammar (a speculative draft): row i is the request
    after the draft's first i tokens, unmasked."""
    return [DraftRow(req.prompt_ids, req.output_ids + draft_ids[:i], req.sampling, req.seed, None)
            for i in range(len(draft_ids) + 1)]


def accepted(draft_ids: list[int], picked: list[int]) -> list[int]:
    """The tokens a verify item produced: the draft's prefix that matches the picks, plus the
    pick after it (picked[i] is the token after the draft's first i tokens)."""
    n = 0
    while n < len(draft_ids) and picked[n] == draft_ids[n]:
        n += 1
    return picked[:n + 1]
