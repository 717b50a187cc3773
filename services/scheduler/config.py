"""The scheduler's configuration."""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = field(default=64, metadata={"help": "requests decoding at once"})
    max_prefill_tokens: int = field(default=4096, metadata={"help": "prefill tokens admitted per step"})
    chunked_prefill_size: int = field(default=1024, metadata={
        "help": "prefill chunk per step; -1 disables chunking. Larger chunks run prefill at a higher GEMM "
                "efficiency but stall running decodes longer (a 1,024-token step takes ~0.4 s on 2 cores; "
                "docs/benchmarks.md)"})
    schedule_policy: str = field(default="lpm", metadata={"help": "waiting-queue order: fcfs | lpm (longest prefix match)"})
    lpm_fallback_queue_len: int = field(default=128, metadata={"help": "lpm falls back to fcfs above this queue length"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn the prefix cache off"})
    max_queued_requests: int = field(default=1024, metadata={"help": "waiting requests before new ones are refused"})
    max_queued_tokens: int = field(default=1 << 20, metadata={"help": "waiting prompt tokens before new requests are refused"})
    init_new_token_ratio: float = field(default=0.7, metadata={"help": "share of max_new_tokens reserved per running request"})
    min_new_token_ratio: float = field(default=0.15, metadata={"help": "floor the reservation decays to"})
    new_token_ratio_decay: float = field(default=0.002, metadata={"help": "per-step decay of the reservation ratio"})
    grammar_checker: str = field(default="xgrammar", metadata={
        "help": "structured outputs: the grammar backend that checks constraints here (the worker's "
                "--grammar-backend compiles them)"})
    grammars_remembered: int = field(default=64, metadata={
        "help": "grammars remembered as compiled at the worker (as many as its --grammar-cache-size)"})
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "plan each step only after the last one's result is back; by default the scheduler "
                "(the service, and the in-process Engine) plans step n+1 while the worker runs step n"})
    speculative_disable_batch_size: int = field(default=8, metadata={
        "help": "speculative decoding (the worker's --speculative-algorithm): off while more requests than this "
                "run; below it the depth adapts to the batch and to each request's acceptance "
                "(services/scheduler/speculation.py)"})
    speculative_cost_model: str = field(default="measured", metadata={
        "help": "what prices speculation's drafts: measured (the worker's timed decode steps by tokens and its "
                "drafter's time, so speculation turns off where it does not pay) or fixed (--speculative-row-cost "
                "alone, the same depths on every machine)", "choices": ["measured", "fixed"]})
    speculative_row_cost: float = field(default=0.2, metadata={
        "help": "speculation's cost model before the worker's decode steps are timed: one more token in a step "
                "costs this fraction of a one-token step; from the first timed steps on, the measured costs by "
                "tokens and the drafter's measured time decide (services/scheduler/step_costs.py)"})
    def __post_init__(self) -> None:
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"--schedule-policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be positive or -1 (off)")
        if self.speculative_disable_batch_size < 0:
            raise ValueError("--speculative-disable-batch-size must be >= 0")
        if self.speculative_cost_model not in ("measured", "fixed"):
            raise ValueError(f"--speculative-cost-model must be measured or fixed, got {self.speculative_cost_model!r}")
        if not self.speculative_row_cost > 0:
            raise ValueError("--speculative-row-cost must be > 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")

    @property
    def prefill_budget(self) -> int:
        if self.chunked_prefill_size > 0:
            return min(self.max_prefill_tokens, self.chunked_prefill_size)
        return self.max_prefill_tokens
