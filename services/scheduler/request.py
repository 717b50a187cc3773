"""A request as the scheduler sees it: tokens, progress, and the KV it holds."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from services.common.sampling_params import SamplingParams
from services.scheduler.radix_cache import TreeNode

if TYPE_CHECKING:
    from services.scheduler.disaggregation import PDSpec


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    namespace: str = ""  # tenant and adapter identity: part of the prefix-cache and kvstore keys
    adapter: str = ""  # the LoRA adapter it runs under, by name ("" = the base model)
    arrival_time: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    # KV: pages[i] holds positions [i*ps, (i+1)*ps). The first `tree_tokens`
    # tokens' pages belong to the radix tree (locked through `node`); the rest
    # are private to this request.
    pages: list[int] = field(default_factory=list)
    node: TreeNode | None = None
    tree_tokens: int = 0
    computed: int = 0  # tokens of `seq` whose KV is in the pool or written by a step already sent
    # Tokens sampled by steps sent but not processed yet (overlapped scheduling: the
    # next plan is built while the worker runs the last one): not in output_ids yet.
    unsampled: int = 0
    # Jump-forward: the tokens the grammar forces after the last output token (the worker's draft,
    # planned as a verify item), and whether the request is between a draft and its verify.
    draft: list[int] = field(default_factory=list)
    jumping: bool = False
    # Speculation: the draft came from the speculative drafter (else a grammar forced it), and
    # the request's counters: verify items run, tokens drafted, drafted tokens accepted.
    draft_speculative: bool = False
    verifying_speculative: bool = False
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    cached_tokens: int = 0  # prefix reused from the cache at (first) admission
    pages_changed: bool = True  # worker must receive the full page table next step
    sent_pages: int = 0  # pages the worker already has for this request
    worker_has_state: bool = False
    retractions: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    first_token_time: float | None = None
    admit_time: float | None = None
    # HiCache (services/scheduler/hicache.py): keys of seq's full pages computed so
    # far, leading pages known to be in the kvstore, and the store probe's state.
    page_keys: list[bytes] = field(default_factory=list)
    store_pages: int = 0
    store_state: str = ""  # "" not probed yet | "probed" | "prefetching"
    pd: "PDSpec | None" = None  # its part in a disaggregated pair (services/scheduler/disaggregation.py)
    # Prompt logprobs and embedding (services/scheduler/prompt_outputs.py): gathered from the worker's
    # results until the first output carries them.
    prompt_logprobs: list = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)
    extras_sent: bool = False

    @property
    def seq(self) -> list[int]:
        """Every token whose KV the request will need: prompt then outputs."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def tokens(self, start: int, n: int) -> list[int]:
        """seq[start:start + n] without building seq (the decode path asks every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:start - p + n]
        return self.seq[start:start + n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens still to run before the next sample: the prompt (and, after a
        retraction, the outputs) while prefilling; 1 (the last sampled token,
        whose KV is not computed yet, maybe not even known yet) while decoding."""
        return self.seq_len + self.unsampled - self.computed

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids) - self.unsampled, 0)

    @property
    def last_token_pending(self) -> bool:
        """Its next input is a token a step in flight samples: the worker fills it in."""
        return self.unsampled > 0 and self.computed >= self.seq_len
