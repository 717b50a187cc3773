"""Jump-forward changes no output: every structured case of bench/common/structured_cases.py, greedy and
at one seed, gives the same tokens with jump-forward on and off (float32: the verify items run as
extends, and only float32 makes logits independent of how tokens were batched), under overlapped
scheduling and (greedy only: the seeded draws take the same path) lockstep; and it saves model steps (a verify item carries the forced tokens)."""
from __future__ import annotations

import gc

import pytest

from bench.common.structured_cases import CHOICE_CASES, EBNF_CASES, MAX_TOKENS, REGEX_CASES, SCHEMA_CASES
from services.common.grammar.constraint import EBNF, REGEX, Constraint, choice, json_schema
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

pytestmark = pytest.mark.slow

LONG_KEYS = {"type": "object", "additionalProperties": False,
             "required": ["customer_full_name", "customer_account_identifier", "preferred_contact_method"],
             "properties": {"customer_full_name": {"type": "string", "maxLength": 30},
                            "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
                            "preferred_contact_method": {"enum": ["email", "phone"]}}}


def cases() -> list[tuple[str, Constraint]]:
    out = [(prompt, json_schema(schema)) for _, prompt, schema in SCHEMA_CASES]
    out += [(prompt, Constraint(REGEX, spec)) for _, prompt, spec in REGEX_CASES]
    out += [(prompt, choice(options)) for _, prompt, options in CHOICE_CASES]
    out += [(prompt, Constraint(EBNF, grammar)) for _, prompt, grammar, _ in EBNF_CASES]
    return out + [("Make a customer record for Bob Smith, account 1234, email.", json_schema(LONG_KEYS))]


def run_all(checkpoint, tokenizer, jump_forward: bool, overlap: bool) -> tuple[list[list[int]], int, int]:
    """(token ids per case and sampling, model steps, tokens that rode a verify item); lockstep
    runs the greedy cases only."""
    # One request at a time: a small pool is plenty (and four engines in one module stay light).
    engine = Engine(worker=WorkerConfig(dtype="float32", jump_forward=jump_forward, kv_cache_bytes=64 << 20),
                    scheduler=SchedulerConfig(disable_overlap_schedule=not overlap), checkpoint=checkpoint,
                    tokenizer=tokenizer)
    try:
        samplings = ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7})[:2 if overlap else 1]
        todo = [(prompt, c, kw) for prompt, c in cases() for kw in samplings]
        ids = []
        for prompt, c, kw in todo:  # one at a time: steps per request are what jump-forward saves
            out = engine.generate(messages=[{"role": "user", "content": prompt}],
                                  sampling=SamplingParams(max_new_tokens=MAX_TOKENS, constraint=c, **kw))
            ids.append(out.token_ids)
        return ids, engine.scheduler.stats.steps, engine.scheduler.stats.jump_forward_tokens
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # the engine's threads and loop form cycles: free its KV pool and weights now


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "lockstep"])
def test_jump_forward_gives_the_same_tokens_in_fewer_steps(checkpoint, tokenizer, overlap):
    masked, masked_steps, none = run_all(checkpoint, tokenizer, jump_forward=False, overlap=overlap)
    jumped, jumped_steps, forced = run_all(checkpoint, tokenizer, jump_forward=True, overlap=overlap)
    assert none == 0
    for i, (a, b) in enumerate(zip(masked, jumped)):
        assert a == b, f"case {i}: jump-forward changed the output"
    assert forced > 0 and jumped_steps < masked_steps, (forced, jumped_steps, masked_steps)
