"""The workloads: each a list of Conversation (a single-turn request is a one-turn conversation).

Every dataset is a pure function of (BenchConfig, WordPool): the same seed gives the same
prompts, lengths and order, so two servers (or two runs) see the same workload.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from services.loadgen.config import BenchConfig
from services.loadgen.words import WordPool

BUNDLED_SHAREGPT_LIKE = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data", "sharegpt_like.json")


@dataclass(frozen=True)
class Turn:
    text: str        # completions: the whole prompt; chat: this turn's user message
    input_len: int   # tokens of `text` (exact when the word pool is)
    output_len: int  # max_tokens


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another; a chat conversation resends the earlier turns (and the
    server's answers to them) with each new user message."""
    turns: tuple[Turn, ...]
    chat: bool = False
    group: int | None = None  # generated-shared-prefix: the system prompt's group


def _length(rng: random.Random, full: int, ratio: float) -> int:
    """Uniform in [max(1, ratio * full), full]."""
    return rng.randint(max(1, int(ratio * full)), full)


def random_dataset(cfg: BenchConfig, pool: WordPool) -> list[Conversation]:
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_prompts):
        n_in, n_out = _length(rng, cfg.input_len, cfg.range_ratio), _length(rng, cfg.output_len, cfg.range_ratio)
        out.append(Conversation((Turn(pool.text(n_in, rng), n_in, n_out),)))
    return out


def load_length_pairs(path: str | None) -> list[tuple[int, int]]:
    """[input, output] pairs from a JSON file: {"pairs": [[i, o], ...]} or a bare list."""
    with open(path or BUNDLED_SHAREGPT_LIKE) as f:
        doc = json.load(f)
    pairs = doc["pairs"] if isinstance(doc, dict) else doc
    out = [(int(i), int(o)) for i, o in pairs]
    if not out or any(i < 1 or o < 1 for i, o in out):
        raise ValueError(f"{path}: expected a non-empty list of [input, output] pairs of positive ints")
    return out


def sharegpt_like_dataset(cfg: BenchConfig, pool: WordPool) -> list[Conversation]:
    rng = random.Random(cfg.seed)
    pairs = load_length_pairs(cfg.dataset_path)
    picks = rng.sample(pairs, cfg.num_prompts) if cfg.num_prompts <= len(pairs) else \
        [rng.choice(pairs) for _ in range(cfg.num_prompts)]
    return [Conversation((Turn(pool.text(i, rng), i, o),)) for i, o in picks]


def shared_prefix_dataset(cfg: BenchConfig, pool: WordPool) -> list[Conversation]:
    """Group-major order: all of group 0's questions, then group 1's... so the requests in flight
    together mostly share a system prompt (as a burst of users of one app would)."""
    rng = random.Random(cfg.seed)
    out = []
    for g in range(cfg.gsp_groups):
        system = pool.text(cfg.gsp_system_prompt_len, rng)
        for _ in range(cfg.gsp_prompts_per_group):
            question = pool.text(cfg.gsp_question_len, rng)
            n_in = cfg.gsp_system_prompt_len + cfg.gsp_question_len
            out.append(Conversation((Turn(system + question, n_in, cfg.output_len),), group=g))
    return out


def multi_turn_dataset(cfg: BenchConfig, pool: WordPool) -> list[Conversation]:
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_prompts):
        turns = []
        for _ in range(cfg.turns):
            n_in, n_out = _length(rng, cfg.input_len, cfg.range_ratio), _length(rng, cfg.output_len, cfg.range_ratio)
            turns.append(Turn(pool.text(n_in, rng), n_in, n_out))
        out.append(Conversation(tuple(turns), chat=True))
    return out


DATASETS = {
    "random": random_dataset,
    "sharegpt-like": sharegpt_like_dataset,
    "generated-shared-prefix": shared_prefix_dataset,
    "multi-turn": multi_turn_dataset,
}


def build_dataset(cfg: BenchConfig, pool: WordPool) -> list[Conversation]:
    return DATASETS[cfg.dataset](cfg, pool)
