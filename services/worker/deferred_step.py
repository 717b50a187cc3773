"""A step whose sampled tokens are still crossing to the host: the overlapped loop on CUDA.

The runner samples on the device and starts a non-blocking copy of the tokens into pinned host
memory, recording an event after it (ModelRunner.execute(defer=True)). The step's result is
completed later, once the next step's forward is queued behind that copy, so the host never
waits for the GPU in the step's critical path. Meanwhile the next step's LAST_SAMPLED inputs
come from the runner's device-side last_token, and a request's `unapplied` count says how many
of its tokens the host has not seen yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from services.step.contract import StepResult


@dataclass
class DeferredStep:
    result: StepResult  # filled by complete()
    items: list  # the sampled StepItems, in result order
    reqs: list  # their requests (the runner's _Request: row, output_ids, unapplied)
    tokens: torch.Tensor  # [R] int64 on the host (pinned on CUDA), filled by a non-blocking copy
    copied: Any  # torch.cuda.Event recorded after that copy; None on the CPU

    @classmethod
    def start(cls, picked: torch.Tensor, result: StepResult, items: list, reqs: list) -> "DeferredStep":
        """picked [R] int64 on the device: start its copy to the host; the requests count it."""
        copied = None
        if picked.is_cuda:
            tokens = torch.empty(picked.shape, dtype=torch.int64, pin_memory=True)
            tokens.copy_(picked, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            tokens = picked
        for req in reqs:
            req.unapplied += 1
        return cls(result, items, reqs, tokens, copied)

    def complete(self, take: Callable[[Any, str, list[int]], list[int]]) -> None:
        """Wait for the copy (long done once the next step is queued behind it), hand each
        request its token (take(req, rid, [token]), the runner's _take), fill the result."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens = self.tokens.tolist()
        for req, item, token in zip(self.reqs, self.items, tokens):
            req.unapplied -= 1
            take(req, item.rid, [token])  # no grammar on a deferred row: nothing is forced
        self.result.rids += [item.rid for item in self.items]
        self.result.next_token_ids += tokens
        self.result.logprobs += [None] * len(tokens)
