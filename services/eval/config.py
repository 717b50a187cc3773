"""`radixmesh eval`'s configs: the worker's flags (the configuration measured) plus the harness's."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.config import DTYPES, WorkerConfig


@dataclass(frozen=True)
class PerplexityConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    corpus: str = field(default="kjv", metadata={
        "help": "a bundled corpus (kjv: King James Bible, Genesis-Exodus 20; code: CPython's heapq.py) or a "
                "UTF-8 text file (services/eval/corpus/README.md)"})
    max_tokens: int | None = field(default=4096, metadata={
        "help": "evaluate the corpus's first this many tokens; none: all of it (kjv is ~70k tokens: ~1 min "
                "per 3k tokens/s of prefill, twice that with --stride = --window / 2)"})
    window: int = field(default=1024, metadata={"help": "tokens per window (one request each)"})
    stride: int = field(default=512, metadata={
        "help": "windows start every this many tokens; each scores the tokens the last one did not, with "
                "window - stride tokens of context before them"})
    chunk: int = field(default=256, metadata={
        "help": "prefill chunk: a window runs as window / chunk prefill steps, each attending to the K/V the "
                "earlier ones wrote to the paged pool"})

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2 (or none), got {self.max_tokens}")
        if self.window < 2:
            raise ValueError(f"--window must be >= 2, got {self.window}")
        if not 1 <= self.stride <= self.window:
            raise ValueError(f"--stride must be in [1, --window={self.window}], got {self.stride}")
        if self.chunk < 1:
            raise ValueError(f"--chunk must be >= 1, got {self.chunk}")


@dataclass(frozen=True)
class AgreementConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    reference_dtype: str = field(default="float32", metadata={
        "help": "the reference's --dtype (its other worker flags are the defaults: dense weights, KV in its dtype)"})
    reference_model: str | None = field(default=None, metadata={
        "help": "the reference's checkpoint (default: --model; give the source of a requantized file)"})
    new_tokens: int = field(default=32, metadata={"help": "greedy tokens generated per prompt (eos ignored)"})

    def __post_init__(self) -> None:
        if self.reference_dtype not in DTYPES:
            raise ValueError(f"--reference-dtype must be one of {sorted(DTYPES)}, got {self.reference_dtype!r}")
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens must be >= 1, got {self.new_tokens}")
