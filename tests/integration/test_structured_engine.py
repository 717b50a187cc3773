"""Structured outputs on the real model through the in-process Engine: every JSON-schema case of
bench/common/structured_cases.py greedy and sampled (parses, validates with formats checked, ends on
STOP), the regex / choice / EBNF cases, bad constraints refused at submit with xgrammar's reason,
the grammar cache shared by equal schemas, and masking that stays in its own row of the batch.

All the cases run as one batch (module fixture `outputs`), so the suite takes seconds, not minutes."""
from __future__ import annotations

import gc
import json
import re

import jsonschema
import pytest

from bench.common.structured_cases import CHOICE_CASES, EBNF_CASES, MAX_TOKENS, REGEX_CASES, SCHEMA_CASES
from services.common.grammar.constraint import EBNF, REGEX, Constraint, choice, json_schema
from services.common.outputs import FinishReason
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.engine.engine import Engine
from services.worker.config import WorkerConfig
from tests.integration.reference import NEAR_TIE

pytestmark = pytest.mark.slow

SAMPLINGS = {"greedy": dict(temperature=0.0), "t0.8-seed1": dict(temperature=0.8, seed=1),
             "t0.8-seed2": dict(temperature=0.8, seed=2)}
FORMATS = jsonschema.FormatChecker()


@pytest.fixture(scope="module")
def engine(checkpoint, tokenizer):
    """float32, as the reference tests run: "auto" is bfloat16 on a CPU with fast bf16, where a batch's
    shape alone flips greedy near-ties, and test_masking_stays_in_its_row compares batched with alone."""
    eng = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=512 << 20), checkpoint=checkpoint,
                 tokenizer=tokenizer)
    yield eng
    eng.shutdown()
    del eng
    gc.collect()  # free the KV pool and weights before the next module


def chat(engine: Engine, prompt: str) -> list[int]:
    return engine.prompt_ids(messages=[{"role": "user", "content": prompt}])


def jobs() -> list[tuple[tuple, str, Constraint, dict]]:
    """(key, prompt, constraint, sampling kwargs) of every case: the schemas under each sampling,
    the regex / choice / EBNF cases greedy and at one seed."""
    out = [(("schema", name, label), prompt, json_schema(schema), kw)
           for name, prompt, schema in SCHEMA_CASES for label, kw in SAMPLINGS.items()]
    extras = [("regex", n, p, Constraint(REGEX, spec)) for n, p, spec in REGEX_CASES]
    extras += [("choice", n, p, choice(opts)) for n, p, opts in CHOICE_CASES]
    extras += [("ebnf", n, p, Constraint(EBNF, grammar)) for n, p, grammar, _ in EBNF_CASES]
    for kind, name, prompt, c in extras:
        for label in ("greedy", "t0.8-seed1"):
            out.append(((kind, name, label), prompt, c, SAMPLINGS[label]))
    return out


@pytest.fixture(scope="module")
def outputs(engine):
    """Every case at once, as one batch: key -> RequestOutput."""
    todo = jobs()
    prompts = [chat(engine, prompt) for _, prompt, _, _ in todo]
    params = [SamplingParams(max_new_tokens=MAX_TOKENS, constraint=c, **kw) for _, _, c, kw in todo]
    results = engine.generate_batch(prompts, params)
    return {key: out for (key, _, _, _), out in zip(todo, results)}


def finished_by_grammar(out, label: str) -> None:
    assert out.error is None, f"{label}: {out.error}"
    assert out.finish_reason == FinishReason.STOP, (
        f"{label}: finished {out.finish_reason} after {out.completion_tokens} tokens: {out.text!r}")


def test_the_cases_cover_the_schema_features():
    assert len(SCHEMA_CASES) >= 26 and len({n for n, _, _ in SCHEMA_CASES}) == len(SCHEMA_CASES)
    text = json.dumps([s for _, _, s in SCHEMA_CASES])
    for feature in ("minItems", "maxItems", "enum", "anyOf", "minimum", "maximum", "exclusiveMinimum", "pattern",
                    '"format": "date"', '"format": "uuid"', "minLength", "maxLength", '"additionalProperties": false',
                    '"boolean"', '["string", "null"]', "const", "$defs", "$ref"):
        assert feature in text, feature


@pytest.mark.parametrize("label", SAMPLINGS)
@pytest.mark.parametrize("name,schema", [(n, s) for n, _, s in SCHEMA_CASES], ids=[n for n, _, _ in SCHEMA_CASES])
def test_schema_case(outputs, name, schema, label):
    out = outputs[("schema", name, label)]
    finished_by_grammar(out, f"{name} {label}")
    value = json.loads(out.text)
    jsonschema.validate(value, schema, format_checker=FORMATS)
    assert "\n" not in out.text, out.text  # compact layout: no free whitespace (a string's newline is escaped)


@pytest.mark.parametrize("label", ["greedy", "t0.8-seed1"])
@pytest.mark.parametrize("name,pattern", [(n, p) for n, _, p in REGEX_CASES], ids=[n for n, _, _ in REGEX_CASES])
def test_regex_case(outputs, name, pattern, label):
    out = outputs[("regex", name, label)]
    finished_by_grammar(out, f"{name} {label}")
    assert re.fullmatch(pattern, out.text), f"{name} {label}: {out.text!r} does not match {pattern!r}"


@pytest.mark.parametrize("label", ["greedy", "t0.8-seed1"])
@pytest.mark.parametrize("name,options", [(n, o) for n, _, o in CHOICE_CASES], ids=[n for n, _, _ in CHOICE_CASES])
def test_choice_case(outputs, name, options, label):
    out = outputs[("choice", name, label)]
    finished_by_grammar(out, f"{name} {label}")
    assert out.text in options, f"{name} {label}: {out.text!r} not in {options}"


@pytest.mark.parametrize("label", ["greedy", "t0.8-seed1"])
@pytest.mark.parametrize("name,pattern", [(n, r) for n, _, _, r in EBNF_CASES], ids=[n for n, _, _, _ in EBNF_CASES])
def test_ebnf_case(outputs, name, pattern, label):
    out = outputs[("ebnf", name, label)]
    finished_by_grammar(out, f"{name} {label}")
    assert re.fullmatch(pattern, out.text), f"{name} {label}: {out.text!r} does not match {pattern!r}"


BAD = [
    ("unknown_type", json_schema({"type": "object", "properties": {"a": {"type": "foo"}}}), 'Unsupported type "foo"'),
    ("not_json", Constraint("json_schema", "{not json"), "Failed to parse JSON"),
    ("dangling_ref", json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "Cannot find field '$defs'"),
    ("empty_range", json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    ("unclosed_group", Constraint(REGEX, "a(b"), "parenthesis is not closed"),
    ("reversed_class", Constraint(REGEX, "[z-a]"), "lower bound is larger than upper bound"),
    ("undefined_rule", Constraint(EBNF, "root ::= foo"), 'Rule "foo" is not defined'),
    ("unterminated_string", Constraint(EBNF, 'root ::= "a'), "in string literal"),
    ("empty_choice", choice([]), "non-empty list"),
    ("unknown_kind", Constraint("grammar-of-doom", "x"), "unknown constraint kind"),
]


@pytest.mark.parametrize("constraint,fragment", [(c, f) for _, c, f in BAD], ids=[n for n, _, _ in BAD])
def test_bad_constraint_is_refused_at_submit(engine, constraint, fragment):
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, constraint=constraint)
    with pytest.raises(InvalidRequest) as info:
        engine.generate(messages=[{"role": "user", "content": "Hi"}], sampling=sp, timeout=60)
    message = str(info.value)
    assert fragment in message, message
    assert "/project/cpp" not in message and not message.startswith("["), message  # xgrammar's location cut
    assert len(engine.scheduler.grammars) == 0  # nothing was queued


def test_engine_serves_after_bad_constraints(engine):
    for _, c, _ in BAD:
        with pytest.raises(InvalidRequest):
            engine.submit(chat(engine, "Hi"), SamplingParams(max_new_tokens=4, constraint=c), lambda chunk: None)
    plain = engine.generate(messages=[{"role": "user", "content": "Say hello."}],
                            sampling=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), timeout=60)
    assert plain.error is None and plain.finish_reason == FinishReason.LENGTH and plain.completion_tokens == 8
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    good = engine.generate(messages=[{"role": "user", "content": "Is it ok? Answer as JSON."}], timeout=60,
                           sampling=SamplingParams(max_new_tokens=16, temperature=0.0, constraint=json_schema(schema)))
    finished_by_grammar(good, "after bad constraints")
    jsonschema.validate(json.loads(good.text), schema)


def reordered(schema: dict) -> dict:
    """The same schema with every object's keys in reverse order."""
    if isinstance(schema, dict):
        return {k: reordered(schema[k]) for k in reversed(list(schema))}
    if isinstance(schema, list):
        return [reordered(v) for v in schema]
    return schema


def test_same_schema_in_another_key_order_compiles_once(engine):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rooms"],
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "rooms": {"type": "integer", "minimum": 1, "maximum": 9}}}
    a, b = json_schema(schema), json_schema(reordered(schema))
    assert a.spec != b.spec and a.key == b.key
    stats = engine.runner.grammars.stats
    ask = [{"role": "user", "content": "A flat in Rome with 3 rooms, as JSON."}]
    misses, hits, prepared = stats.misses, stats.hits, engine.scheduler.grammars.prepared_count
    first = engine.generate(messages=ask, timeout=60, sampling=SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                              constraint=a))
    assert stats.misses == misses + 1
    second = engine.generate(messages=ask, timeout=60, sampling=SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                               constraint=b))
    assert stats.misses == misses + 1 and stats.hits >= hits + 1
    assert engine.scheduler.grammars.prepared_count == prepared + 1  # the second was admitted at once
    assert stats.compiles_on_step_thread == 0
    for out in (first, second):
        finished_by_grammar(out, "cached schema")
        jsonschema.validate(json.loads(out.text), schema)
    assert first.token_ids == second.token_ids


def test_concurrent_requests_for_one_new_schema_compile_once(engine):
    schema = {"type": "object", "additionalProperties": False, "required": ["animal", "legs"],
              "properties": {"animal": {"enum": ["cat", "dog", "bird"]},
                             "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}
    variants = [json_schema(schema), json_schema(reordered(schema)),
                Constraint("json_schema", json.dumps(schema, indent=2))]
    stats = engine.runner.grammars.stats
    misses = stats.misses
    ids = chat(engine, "A dog and its legs, as JSON.")
    outs = engine.generate_batch([ids] * 6, [SamplingParams(max_new_tokens=24, temperature=0.8, seed=s,
                                                            constraint=variants[s % 3]) for s in range(6)])
    assert stats.misses == misses + 1
    for out in outs:
        finished_by_grammar(out, "one new schema, six requests")
        jsonschema.validate(json.loads(out.text), schema)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def top2_gap(lp) -> float:
    return lp.top[0].logprob - lp.top[1].logprob


def test_masking_stays_in_its_row(engine):
    """Unconstrained greedy rows batched with constrained ones (greedy and sampled) get the tokens
    they get alone (up to a true near-tie of the run alone, as in tests/integration/reference.py)."""
    plain = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    free_prompts = [chat(engine, p) for p in ("Tell me about the sea.", "Write a short poem about cats.",
                                              "What is 2 plus 2?")]
    alone = [engine.generate(input_ids=ids, sampling=plain, timeout=60) for ids in free_prompts]
    _, prompt, schema = SCHEMA_CASES[1]
    constrained = [
        (chat(engine, prompt), SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0,
                                              constraint=json_schema(schema))),
        (chat(engine, prompt), SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.8, seed=3,
                                              constraint=json_schema(schema))),
        (chat(engine, REGEX_CASES[0][1]), SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0,
                                                         constraint=Constraint(REGEX, REGEX_CASES[0][2]))),
        (chat(engine, CHOICE_CASES[0][1]), SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.8, seed=4,
                                                          constraint=choice(CHOICE_CASES[0][2]))),
    ]
    # Interleave: constrained, free, constrained, free, ... so masked rows sit between free ones.
    mixed: list[tuple[list[int], SamplingParams, int | None]] = []
    for i in range(max(len(constrained), len(free_prompts))):
        if i < len(constrained):
            mixed.append((*constrained[i], None))
        if i < len(free_prompts):
            mixed.append((free_prompts[i], plain, i))
    outs = engine.generate_batch([m[0] for m in mixed], [m[1] for m in mixed])
    for (_, sp, free), out in zip(mixed, outs):
        assert out.error is None, out.error
        if free is None:
            assert out.finish_reason == FinishReason.STOP, (out.finish_reason, out.text)
            continue
        ref = alone[free]
        assert len(out.token_ids) == len(ref.token_ids) == plain.max_new_tokens
        at = first_divergence(out.token_ids, ref.token_ids)
        assert at is None or top2_gap(ref.logprobs[at]) <= NEAR_TIE, (
            f"free prompt {free}: token {at} differs from the run alone (top-2 gap there "
            f"{top2_gap(ref.logprobs[at]):.2e}): {out.text!r} vs {ref.text!r}")
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert re.fullmatch(REGEX_CASES[0][2], outs[4].text)
