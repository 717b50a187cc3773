"""BenchConfig: the flags of `radixmesh bench`, generated from this dataclass."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

DATASETS = ("random", "sharegpt-like", "generated-shared-prefix", "multi-turn")
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft:500,tpot:50" → {"ttft": 500.0, "tpot": 50.0} (milliseconds). Raises ValueError."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo takes METRIC:MS pairs with METRIC in {SLO_METRICS}, got {part!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {name}: {value!r} is not a number of milliseconds") from None
        if out[name] <= 0:
            raise ValueError(f"--slo {name} must be > 0 ms, got {value}")
    return out


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = field(default="http://127.0.0.1:8000", metadata={
        "help": "the server's root URL (its OpenAI routes are under /v1)"})
    model: str | None = field(default=None, metadata={
        "help": "the `model` to send; none = the first id of GET /v1/models"})
    dataset: str = field(default="random", metadata={"help": "the workload", "choices": DATASETS})
    num_prompts: int = field(default=64, metadata={
        "help": "requests (random, sharegpt-like) or conversations (multi-turn); generated-shared-prefix "
                "sends groups x prompts per group instead"})
    input_len: int = field(default=256, metadata={
        "help": "random: prompt tokens; multi-turn: tokens of each user message"})
    output_len: int = field(default=128, metadata={
        "help": "max_tokens of each request (random, generated-shared-prefix, multi-turn)"})
    range_ratio: float = field(default=1.0, metadata={
        "help": "random, multi-turn: lengths drawn uniformly from [ratio*len, len]; 1.0 = fixed lengths"})
    dataset_path: str | None = field(default=None, metadata={
        "help": "sharegpt-like: a JSON file of [input, output] length pairs; none = bench/data/sharegpt_like.json"})
    gsp_groups: int = field(default=8, metadata={"help": "generated-shared-prefix: groups (distinct system prompts)"})
    gsp_prompts_per_group: int = field(default=16, metadata={"help": "generated-shared-prefix: questions per group"})
    gsp_system_prompt_len: int = field(default=1000, metadata={
        "help": "generated-shared-prefix: tokens of each group's system prompt"})
    gsp_question_len: int = field(default=32, metadata={"help": "generated-shared-prefix: tokens of each question"})
    turns: int = field(default=4, metadata={"help": "multi-turn: user turns per conversation"})
    tokenizer: str | None = field(default="default", metadata={
        "help": "a .gguf or HF directory whose tokenizer calibrates prompt lengths; default = the default "
                "model's GGUF; none = a built-in word list (about one token per word)"})
    request_rate: float = field(default=math.inf, metadata={
        "help": "conversations started per second (Poisson, seeded); inf = all at once"})
    max_concurrency: int | None = field(default=None, metadata={
        "help": "at most this many requests in flight; none = no limit"})
    ignore_eos: bool = field(default=False, metadata={
        "help": "send ignore_eos: true so every request produces max_tokens (ours, llama-server, vLLM honour it)"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature sent with every request"})
    extra_body: str | None = field(default=None, metadata={
        "help": "a JSON object merged into every request body, e.g. '{\"min_tokens\": 128}'"})
    seed: int = field(default=0, metadata={"help": "seeds prompts, lengths and arrival times"})
    slo: str | None = field(default=None, metadata={
        "help": "goodput SLO, e.g. ttft:500,tpot:50 (ms; also itl, e2e): requests meeting every bound count"})
    warmup_requests: int = field(default=1, metadata={
        "help": "short requests sent (and not measured) before the run, to each server"})
    timeout_s: float = field(default=600.0, metadata={"help": "per-request timeout"})
    output_file: str | None = field(default=None, metadata={"help": "write the results here as JSON"})
    plot: str | None = field(default=None, metadata={
        "help": "write a PNG here: latency CDFs and output throughput over time (needs matplotlib)"})
    compare: str | None = field(default=None, metadata={
        "help": "a second server's root URL: the same workload runs against both, interleaved in rounds"})
    compare_model: str | None = field(default=None, metadata={
        "help": "--model for the --compare server; none = its first /v1/models id"})
    compare_rounds: int = field(default=4, metadata={
        "help": "--compare: the workload is cut into this many slices; slice r runs on both (A,B then B,A ...)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar (tqdm) on stderr"})

    def __post_init__(self) -> None:
        parse_slo(self.slo)
        positive = {"num_prompts": self.num_prompts, "input_len": self.input_len, "output_len": self.output_len,
                    "gsp_groups": self.gsp_groups, "gsp_prompts_per_group": self.gsp_prompts_per_group,
                    "gsp_system_prompt_len": self.gsp_system_prompt_len, "turns": self.turns,
                    "gsp_question_len": self.gsp_question_len, "compare_rounds": self.compare_rounds}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0.0 < self.range_ratio <= 1.0:
            raise ValueError(f"--range-ratio must be in (0, 1], got {self.range_ratio}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1 or none, got {self.max_concurrency}")
        if self.warmup_requests < 0 or self.timeout_s <= 0:
            raise ValueError("--warmup-requests must be >= 0 and --timeout-s > 0")
        if self.extra_body is not None:
            try:
                ok = isinstance(json.loads(self.extra_body), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--extra-body must be a JSON object, got {self.extra_body!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {DATASETS}, got {self.dataset!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")

    @property
    def extra(self) -> dict:
        return json.loads(self.extra_body) if self.extra_body else {}

    @property
    def slo_ms(self) -> dict[str, float]:
        return parse_slo(self.slo)
