"""Drafting with a second, smaller model of the same vocabulary (--speculative-algorithm STANDALONE).

The draft model runs in the target's worker on a ModelRunner of its own, with its own paged KV
pool, and this drafter is that runner's scheduler: a free list of the draft pool's pages, each
request's page list, and which of its tokens the pool holds KV for. A proposal runs one extend
step (every request's tokens the pool lacks, through its last true token → its first draft
token), then batched decode steps, each feeding the previous draft token; every token is the
draft model's argmax (temperature 0).

The pool's KV after a proposal covers the request's true tokens and the draft tokens fed back;
the target may reject some, so the next proposal first rolls a request back to the longest
prefix its true tokens share with that KV (later slots get overwritten), and frees the pages it
no longer needs. A request the pool has no room for, or whose draft would run past the draft
model's context, gets no draft that step: never an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import Checkpoint, load_checkpoint
from services.worker.speculative.drafter import DraftRequest

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _Draft:
    tokens: list[int]  # the request's true tokens: prompt and accepted output
    kv_true: int = 0  # tokens[:kv_true] have their KV in the draft pool ...
    kv_draft: list[int] = field(default_factory=list)  # ... followed by these draft tokens'
    pages: list[int] = field(default_factory=list)  # the draft pool pages holding them, in order
    admitted: bool = False  # the draft runner holds the request (its page-table row)


class DraftModelDrafter:
    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint, vocab_size: int,
                 new_runner: Callable[[WorkerConfig, Checkpoint], Any]):
        """`config`: the draft runner's own (no speculation); `vocab_size`: the target's;
        `new_runner(config, checkpoint)`: a runner for the draft model (the target runner's class:
        the runner builds its drafter, so this module never imports it). Raises ValueError when
        the draft model's vocabulary differs (its token ids would mean other text)."""
        if checkpoint.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model {checkpoint.config.name!r} has a vocabulary of "
                             f"{checkpoint.config.vocab_size} tokens, the target {vocab_size}: "
                             "--speculative-draft-model-path needs a model of the target's tokenizer")
        self.runner = new_runner(config, checkpoint)
        self.page_size = self.runner.kv_spec.page_size
        self.max_positions = self.runner.model_config.max_position_embeddings
        self.free_pages = list(range(self.runner.kv_spec.num_pages - 1, -1, -1))
        self.drafts: dict[str, _Draft] = {}
        self.step_id = 0

    @classmethod
    def from_config(cls, config: WorkerConfig, runner: Any) -> "DraftModelDrafter":
        """The target's config and runner → a drafter on --speculative-draft-model-path, with the
        target's page size, request rows, dtype and device, and its own KV budget, run by a runner
        of the target's own class."""
        path = config.speculative_draft_model_path
        draft_config = replace(config, model=path, speculative_algorithm=None, speculative_draft_model_path=None,
                               kv_cache_bytes=config.speculative_draft_kv_cache_bytes, kv_mem_fraction=None,
                               lora_paths=(), max_loras=0)  # the draft model drafts on its base weights
        return cls(draft_config, load_checkpoint(path), runner.model_config.vocab_size, type(runner))

    # --- the Drafter protocol ---------------------------------------------------------
    def admit(self, rid: str, tokens: list[int]) -> None:
        self.release(rid)  # a re-admission (after a retraction) starts over
        self.drafts[rid] = _Draft(list(tokens))

    def extend(self, rid: str, tokens: list[int]) -> None:
        self.drafts[rid].tokens += tokens

    def release(self, rid: str) -> None:
        d = self.drafts.pop(rid, None)
        if d is None:
            return
        self.free_pages += reversed(d.pages)
        if d.admitted:
            self.runner.execute(StepPlan(self._next_step(), released_rids=[rid]))

    def propose(self, batch: list[DraftRequest], hidden: Any = None) -> list[list[int]]:
        depths = {r.rid: self._prepare(self.drafts[r.rid], r.depth) for r in batch if r.depth > 0}
        depths = {rid: n for rid, n in depths.items() if n > 0}
        out: dict[str, list[int]] = {rid: [] for rid in depths}
        if depths:
            self._extend_step(depths, out)
        for j in range(1, max(depths.values(), default=0)):  # decode steps: feed draft token j
            rids = [rid for rid, n in depths.items() if n > j]
            items = []
            for rid in rids:
                d, token = self.drafts[rid], out[rid][-1]
                items.append(StepItem(rid, [token], d.kv_true + len(d.kv_draft), []))
                d.kv_draft.append(token)
            self._run(StepPlan(self._next_step(), items=items), out)
        return [out.get(r.rid, []) for r in batch]

    # --- the draft runner's scheduling ------------------------------------------------
    def _prepare(self, d: _Draft, depth: int) -> int:
        """Roll the request's draft KV back to what its true tokens still agree with, and hold
        pages for `depth` draft tokens → the depth it can draft (0: none: no room, or past the
        draft model's context)."""
        agree = 0
        for token, true in zip(d.kv_draft, d.tokens[d.kv_true:]):
            if token != true:
                break
            agree += 1
        # The last true token always runs: its logits give the first draft token.
        d.kv_true, d.kv_draft = min(d.kv_true + agree, len(d.tokens) - 1), []
        # Draft token j (1-based) is fed at position len(tokens) + j - 2 for token j + 1: the KV
        # holds len(tokens) + depth - 1 tokens at the end, at positions below the model's context.
        depth = min(depth, self.max_positions - len(d.tokens) + 1)
        need = -(-(len(d.tokens) + max(depth, 1) - 1) // self.page_size)
        keep = min(len(d.pages), need)
        self.free_pages += reversed(d.pages[keep:])
        d.pages = d.pages[:keep]
        if depth <= 0 or need - keep > len(self.free_pages):
            return 0
        d.pages += [self.free_pages.pop() for _ in range(need - keep)]
        return depth

    def _extend_step(self, depths: dict[str, int], out: dict[str, list[int]]) -> None:
        """Admit the requests the draft runner lacks, and run every request's tokens its KV lacks,
        through its last true token (its page table sent whole: a rollback may have shortened it)."""
        plan = StepPlan(self._next_step())
        for rid in depths:
            d = self.drafts[rid]
            if not d.admitted:  # the runner's history stays empty: its greedy sampling needs none
                plan.new_requests.append(NewRequestSpec(rid, [], [], GREEDY, 0))
                d.admitted = True
            plan.items.append(StepItem(rid, d.tokens[d.kv_true:], d.kv_true, list(d.pages), reset_pages=True))
            d.kv_true = len(d.tokens)
        self._run(plan, out)

    def _run(self, plan: StepPlan, out: dict[str, list[int]]) -> None:
        result = self.runner.execute(plan)
        for rid, token in zip(result.rids, result.next_token_ids):
            out[rid].append(token)

    def _next_step(self) -> int:
        self.step_id += 1
        return self.step_id

    def check_invariants(self) -> None:
        """Raise AssertionError unless every draft page is free or held by exactly one request."""
        held = [p for d in self.drafts.values() for p in d.pages]
        pages = held + self.free_pages
        assert len(pages) == len(set(pages)) == self.runner.kv_spec.num_pages, (len(held), len(self.free_pages))
