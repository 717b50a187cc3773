"""Structured outputs' core without a model: the scheduler's grammar queue, the worker's grammar
cache (over a fake backend), Constraint.key, the xgrammar backend's checks, and the sampler
masking with a real xgrammar backend over a tiny byte vocabulary."""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from services.common.grammar.backend import GrammarVocab, create_backend
from services.common.grammar.constraint import (CHOICE, EBNF, JSON_SCHEMA, MAX_SPEC_CHARS, REGEX, Constraint,
                                                canonical_spec, choice, json_schema)
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.scheduler.grammar_queue import GrammarQueue
from services.worker.grammar_cache import GrammarCache, GrammarCacheStats

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
SCHEMA_REORDERED = {"required": ["a"], "properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
                    "type": "object"}


# --- GrammarQueue --------------------------------------------------------------------------
@dataclass(eq=False)
class QReq:  # what the queue reads of a scheduler Request
    rid: str
    sampling: SamplingParams


def qreq(rid: str, c: Constraint) -> QReq:
    return QReq(rid, SamplingParams(constraint=c))


A, B, C = Constraint(REGEX, "a+"), Constraint(REGEX, "b+"), Constraint(REGEX, "c+")


def test_queue_holds_requests_and_asks_once_per_grammar():
    q = GrammarQueue()
    r1, r2, r3 = qreq("1", A), qreq("2", B), qreq("3", A)
    for r in (r1, r2, r3):
        q.hold(r)
    assert len(q) == 3
    assert q.take_jobs() == [A, B]  # one job per key, in first-arrival order
    assert q.take_jobs() == []  # taken: not asked again
    q.hold(qreq("4", A))  # its grammar is being prepared already: no new job
    assert q.take_jobs() == [] and len(q) == 4
    q.hold(qreq("5", Constraint(REGEX, "a+")))  # an equal constraint, another object: same key
    assert q.take_jobs() == [] and len(q) == 5


def test_queue_prepared_releases_the_waiters_in_arrival_order():
    q = GrammarQueue()
    reqs = [qreq(str(i), A if i % 2 == 0 else B) for i in range(5)]
    for r in reqs:
        q.hold(r)
    assert not q.is_ready(A)
    assert q.prepared(A.key, ok=True) == [reqs[0], reqs[2], reqs[4]]
    assert q.is_ready(A) and not q.is_ready(B) and q.prepared_count == 1 and len(q) == 2
    assert q.prepared(A.key, ok=True) == []  # nobody left waiting for it
    assert q.prepared(B.key, ok=False) == [reqs[1], reqs[3]]  # failed: released (to end with the error)
    assert not q.is_ready(B) and q.prepared_count == 2 and len(q) == 0


def test_queue_remembers_a_bounded_lru_of_ready_grammars():
    q = GrammarQueue(remembered=2)
    for c in (A, B):
        q.prepared(c.key, ok=True)
    assert q.is_ready(A)  # A is now the most recent
    q.prepared(C.key, ok=True)  # evicts B, the oldest
    assert q.is_ready(A) and q.is_ready(C) and not q.is_ready(B)
    q.forget()  # a new worker: nothing known compiled
    assert not any(map(q.is_ready, (A, B, C)))


def test_queue_remove_takes_out_aborted_waiters_and_their_pending_jobs():
    q = GrammarQueue()
    r1, r2, r3 = qreq("1", A), qreq("2", A), qreq("3", B)
    for r in (r1, r2, r3):
        q.hold(r)
    assert q.remove({"3", "nope"}) == [r3]
    assert q.take_jobs() == [A]  # B's job went with its only request
    assert q.remove({"1"}) == [r1] and len(q) == 1
    assert q.prepared(A.key, ok=True) == [r2]
    assert q.remove({"2"}) == [] and len(q) == 0
    q.hold(qreq("6", B))  # B may be asked for again
    assert q.take_jobs() == [B]


# --- GrammarCache over a fake backend ----------------------------------------------------------
class FakeBackend:
    name = "fake"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.compiled: list[str] = []  # keys, one per compile
        self.gate = gate
        self.started = threading.Event()

    def compile(self, c: Constraint):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.compiled.append(c.key)
        if c.spec == "bad":
            raise InvalidRequest("invalid regex: bad on purpose")
        return ("compiled", c.spec)

    def matcher(self, compiled):
        return ("matcher", compiled)


def make_cache(max_entries: int = 64, gate: threading.Event | None = None) -> tuple[GrammarCache, FakeBackend, list]:
    backend, made = FakeBackend(gate), []

    def make():
        made.append(1)
        return backend

    return GrammarCache(make, max_entries), backend, made


def test_cache_compiles_once_then_hits():
    cache, backend, made = make_cache()
    assert made == []  # built on first use
    was_cached, seconds = cache.prepare(A)
    assert not was_cached and seconds >= 0
    assert cache.prepare(Constraint(REGEX, "a+")) == (True, 0.0)
    assert backend.compiled == [A.key] and made == [1] and len(cache) == 1
    assert cache.stats.misses == 1 and cache.stats.hits == 1 and len(cache.stats.compile_seconds) == 1
    assert cache.matcher(A) == ("matcher", ("compiled", "a+"))
    assert cache.stats.hits == 2 and cache.stats.compiles_on_step_thread == 0
    # JSON specs share an entry across key order and spacing.
    cache.prepare(json_schema(SCHEMA))
    assert cache.prepare(json_schema(SCHEMA_REORDERED)) == (True, 0.0)
    assert cache.prepare(Constraint(JSON_SCHEMA, json.dumps(SCHEMA, indent=4))) == (True, 0.0)
    assert len(backend.compiled) == 2 and made == [1]


def test_cache_evicts_the_least_recently_used_at_max_entries():
    cache, backend, _ = make_cache(max_entries=2)
    cache.prepare(A)
    cache.prepare(B)
    cache.prepare(A)  # A touched: B is the oldest
    cache.prepare(C)
    assert len(cache) == 2 and backend.compiled == [A.key, B.key, C.key]
    assert cache.prepare(A) == (True, 0.0) and cache.prepare(C) == (True, 0.0)
    cache.matcher(A)  # touch A again: C is the oldest
    assert cache.prepare(B)[0] is False  # evicted: compiled again, evicting C
    assert backend.compiled[-1] == B.key and len(cache) == 2
    # Admission asking for an evicted grammar compiles it on the step thread, counted.
    assert cache.matcher(C) == ("matcher", ("compiled", "c+"))
    assert cache.stats.compiles_on_step_thread == 1 and backend.compiled[-1] == C.key and len(cache) == 2


def test_cache_size_must_be_positive():
    with pytest.raises(ValueError, match="grammar cache size must be >= 1, got 0"):
        GrammarCache(FakeBackend, max_entries=0)


def run_threads(n: int, target) -> tuple[list, list]:
    results, errors, lock = [], [], threading.Lock()

    def run():
        try:
            r = target()
            with lock:
                results.append(r)
        except Exception as e:  # noqa: BLE001 - collected for the asserts
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, (results, errors)


def test_concurrent_prepares_of_one_key_compile_once():
    gate = threading.Event()
    cache, backend, made = make_cache(gate=gate)
    threads, (results, errors) = run_threads(8, lambda: cache.prepare(A))
    assert backend.started.wait(10)
    time.sleep(0.2)  # the other seven reach prepare() and wait on the owner's compile
    gate.set()
    for t in threads:
        t.join(10)
    assert errors == [] and len(results) == 8
    assert backend.compiled == [A.key] and made == [1] and cache.stats.misses == 1
    assert sorted(r[0] for r in results) == [False] + [True] * 7
    assert len(cache) == 1 and cache._compiling == {}


def test_a_compile_error_reaches_every_waiter_and_is_not_cached():
    gate = threading.Event()
    cache, backend, _ = make_cache(gate=gate)
    bad = Constraint(REGEX, "bad")
    threads, (results, errors) = run_threads(5, lambda: cache.prepare(bad))
    assert backend.started.wait(10)
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [] and len(errors) == 5
    assert all(isinstance(e, InvalidRequest) and "bad on purpose" in str(e) for e in errors)
    assert backend.compiled == [bad.key] and len(cache) == 0 and cache._compiling == {}
    with pytest.raises(InvalidRequest, match="bad on purpose"):  # not cached: compiled (and failing) again
        cache.prepare(bad)
    assert backend.compiled == [bad.key, bad.key] and cache.stats.misses == 2
    assert cache.prepare(A)[0] is False  # the cache still works


# --- Constraint.key ------------------------------------------------------------------------------
def test_key_canonicalises_json_specs():
    a, b = json_schema(SCHEMA), json_schema(SCHEMA_REORDERED)
    spaced = Constraint(JSON_SCHEMA, json.dumps(SCHEMA, indent=2))
    assert len({a.spec, b.spec, spaced.spec}) == 3
    assert a.key == b.key == spaced.key == json_schema(json.dumps(SCHEMA)).key
    assert canonical_spec(a) == canonical_spec(b) == json.dumps(SCHEMA, sort_keys=True, separators=(",", ":"))
    assert a.key != json_schema({**SCHEMA, "required": ["a", "b"]}).key
    assert choice(["x", "y"]).key == Constraint(CHOICE, '[ "x",  "y" ]').key != choice(["y", "x"]).key
    assert re.fullmatch(r"[0-9a-f]{32}", a.key)


def test_key_tells_kinds_apart_and_keeps_non_json_specs_as_given():
    assert Constraint(REGEX, "a+").key != Constraint(EBNF, "a+").key
    assert Constraint(REGEX, "a +").key != Constraint(REGEX, "a+").key  # spacing matters in a regex
    assert Constraint(EBNF, 'root ::= "a"').key != Constraint(EBNF, 'root  ::=  "a"').key
    broken = Constraint(JSON_SCHEMA, "{not json")
    assert canonical_spec(broken) == "{not json" and broken.key == Constraint(JSON_SCHEMA, "{not json").key
    assert json_schema('{"type": "object"}').spec == '{"type": "object"}'  # a string passes through


# --- the xgrammar backend's checks -----------------------------------------------------------------
@pytest.fixture(scope="module")
def checker():
    from services.common.grammar.xgrammar_backend import XGrammarBackend
    return XGrammarBackend(None)


BAD = [
    (json_schema({"type": "foo"}), 'invalid json_schema: Unsupported type "foo"'),
    (Constraint(JSON_SCHEMA, "{not json"), "invalid json_schema: Check failed"),
    (json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "minLength 5 is greater than maxLength 2"),
    (json_schema({"properties": {"a": {"$ref": "#/$defs/gone"}}}), "Cannot find field '$defs'"),
    (Constraint(REGEX, "a(b"), "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
    (Constraint(REGEX, "[z-a]"), "lower bound is larger than upper bound"),
    (Constraint(EBNF, "root ::= foo"),
     'invalid ebnf: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    (Constraint(EBNF, 'root ::= "a'), "invalid ebnf: EBNF lexer error"),
    (choice([]), "choice must be a non-empty list of non-empty strings"),
    (choice(["a", ""]), "choice must be a non-empty list of non-empty strings"),
    (Constraint(CHOICE, '{"a": 1}'), "choice must be a non-empty list"),
    (Constraint(CHOICE, "[oops"), "choice must be a JSON list of strings"),
    (Constraint("nope", "x"), "unknown constraint kind 'nope'"),
    (Constraint(REGEX, "a" * (MAX_SPEC_CHARS + 1)), f"limit {MAX_SPEC_CHARS}"),
]


@pytest.mark.parametrize("constraint,fragment", BAD, ids=[f"{c.kind}-{i}" for i, (c, _) in enumerate(BAD)])
def test_check_says_why_without_xgrammars_source_location(checker, constraint, fragment):
    with pytest.raises(InvalidRequest) as info:
        checker.check(constraint)
    message = str(info.value)
    assert fragment in message, message
    assert "/project/cpp" not in message and not re.search(r"\[[\d:.]+\]", message), message
    assert "\n" not in message


@pytest.mark.parametrize("constraint", [
    json_schema(SCHEMA), json_schema({"type": "string", "format": "date"}), Constraint(REGEX, r"\d{3}-\d{4}"),
    Constraint(EBNF, 'root ::= "a" | "b"'), choice(['say "hi"', "back\\slash", "ünï"]),
    Constraint(JSON_SCHEMA, '{"type": "object"}'),
], ids=["schema", "format", "regex", "ebnf", "choice", "any-object"])
def test_check_accepts_good_constraints(checker, constraint):
    checker.check(constraint)


def test_a_check_only_backend_cannot_compile(checker):
    with pytest.raises(RuntimeError, match="only check"):
        checker.compile(Constraint(REGEX, "a"))


def test_choice_ebnf_escapes_options():
    from services.common.grammar.xgrammar_backend import choice_ebnf
    assert choice_ebnf(json.dumps(["a", 'b"c'])) == 'root ::= "a" | "b\\"c"'


# --- the sampler with a real grammar over a tiny vocabulary -------------------------------------------
A_, B_, OPEN, CLOSE, EOS, AB, X = range(7)
TOKENS = [b"a", b"b", b"{", b"}", b"", b"ab", b"x"]
V = len(TOKENS)
GRAMMAR = Constraint(EBNF, 'root ::= "{" ("a" | "b")* "}"')
START, INSIDE, DONE = {OPEN}, {A_, B_, CLOSE, AB}, {EOS}


@pytest.fixture(scope="module")
def grammar():
    backend = create_backend("xgrammar", GrammarVocab(token_bytes=TOKENS, stop_token_ids=[EOS]))
    return backend, backend.compile(GRAMMAR)


@dataclass
class Req:
    sampling: SamplingParams
    prompt_ids: list = field(default_factory=lambda: [1, 2, 3])
    output_ids: list = field(default_factory=list)
    seed: int = 7
    matcher: object = None


def allowed_by(matcher, backend) -> set[int]:
    bm = backend.new_bitmask(1)
    matcher.fill_bitmask(bm, 0)
    word = int(bm[0, 0]) & 0xFFFFFFFF
    return {t for t in range(V) if word >> t & 1}


def test_the_tiny_grammar_allows_what_the_test_expects(grammar):
    backend, compiled = grammar
    m = backend.matcher(compiled)
    assert allowed_by(m, backend) == START
    assert m.accept_token(OPEN) and allowed_by(m, backend) == INSIDE
    assert not m.accept_token(X) and not m.accept_token(OPEN)  # forbidden: refused, state unchanged
    assert m.accept_token(AB) and m.accept_token(CLOSE) and allowed_by(m, backend) == DONE
    assert m.accept_token(EOS) and m.terminated


def rigged_logits(rows: int, forbidden_favourite: int = X, seed: int = 0) -> torch.Tensor:
    """Random logits where a token no grammar state allows is far ahead, then `{`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g)
    logits[:, forbidden_favourite] += 50.0
    logits[:, OPEN] += 25.0
    return logits


@pytest.mark.parametrize("logprobs", [False, True], ids=["argmax-shortcut", "general-path"])
def test_run_sampler_picks_only_what_the_grammar_allows(grammar, logprobs):
    from services.worker.sampler_inputs import run_sampler
    backend, compiled = grammar
    greedy = [Req(SamplingParams(temperature=0.0, logprobs=logprobs), matcher=backend.matcher(compiled))
              for _ in range(2)]
    sampled = [Req(SamplingParams(temperature=1.5, logprobs=logprobs), seed=s, matcher=backend.matcher(compiled))
               for s in range(12)]
    reqs = greedy + sampled
    expected_states = [START, INSIDE]
    stats, masked = GrammarCacheStats(), 0
    for step in range(10):
        live = [r for r in reqs if not r.matcher.terminated]  # a terminated one's request has ended
        if not live:
            break
        logits = rigged_logits(len(live), seed=step)
        kept = logits.clone()
        states = [allowed_by(r.matcher, backend) for r in live]
        tokens, lps = run_sampler(logits, live, (EOS,), backend, stats)
        masked += len(live)
        assert torch.equal(logits, kept)  # the caller's logits are left untouched
        assert all(lp is not None for lp in lps) == logprobs
        for b, (r, tok, allowed) in enumerate(zip(live, tokens, states)):
            if step < len(expected_states):
                assert allowed == expected_states[step]
            assert tok in allowed, f"step {step} row {b}: {tok} not in {allowed}"
            if r.sampling.temperature == 0.0:
                assert tok == max(allowed, key=lambda t: logits[b, t].item()), f"step {step} row {b}"
            assert r.matcher.accept_token(tok)
            r.output_ids.append(tok)
    assert stats.masked_rows == masked
    assert all(r.output_ids[0] == OPEN for r in reqs)
    finished = [r for r in reqs if r.matcher.terminated]
    assert finished and all(r.output_ids[-2:] == [CLOSE, EOS] for r in finished)
    assert len({tuple(r.output_ids) for r in sampled}) > 1  # sampled rows still sample


def test_run_sampler_leaves_unconstrained_rows_alone(grammar):
    from services.worker.sampler_inputs import run_sampler
    backend, compiled = grammar
    torch.manual_seed(0)
    logits = rigged_logits(6, seed=3)

    def rows():
        return [Req(SamplingParams(temperature=0.0), matcher=backend.matcher(compiled)),
                Req(SamplingParams(temperature=0.0)),
                Req(SamplingParams(temperature=1.0), seed=11, matcher=backend.matcher(compiled)),
                Req(SamplingParams(temperature=1.0, top_k=3), seed=12),
                Req(SamplingParams(temperature=0.7), seed=13),
                Req(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt_ids=[X])]

    reqs = rows()
    stats = GrammarCacheStats()
    tokens, _ = run_sampler(logits, reqs, (EOS,), backend, stats)
    assert tokens[0] == OPEN and tokens[2] == OPEN and stats.masked_rows == 2
    for b in (1, 3, 4, 5):  # each as it is alone, without any grammar
        alone, _ = run_sampler(logits[b:b + 1], [rows()[b]], (EOS,))
        assert tokens[b] == alone[0], f"row {b}"
    assert tokens[1] == X  # the forbidden favourite, for a row no grammar constrains
    # An all-greedy batch takes the argmax shortcut: the free row still gets its argmax.
    tokens, _ = run_sampler(logits[:2], rows()[:2], (EOS,), backend)
    assert tokens == [OPEN, X]


def test_run_sampler_skips_terminated_matchers(grammar):
    """A matcher that accepted its stop token masks nothing (its request ends; the token is dropped)."""
    from services.worker.sampler_inputs import run_sampler
    backend, compiled = grammar
    done = backend.matcher(compiled)
    for tok in (OPEN, CLOSE, EOS):
        assert done.accept_token(tok)
    assert done.terminated
    live = backend.matcher(compiled)
    stats = GrammarCacheStats()
    reqs = [Req(SamplingParams(temperature=0.0), matcher=done), Req(SamplingParams(temperature=0.0), matcher=live)]
    tokens, _ = run_sampler(rigged_logits(2), reqs, (EOS,), backend, stats)
    assert tokens == [X, OPEN] and stats.masked_rows == 1
    # Only terminated matchers: no bitmask at all.
    stats = GrammarCacheStats()
    assert run_sampler(rigged_logits(1), reqs[:1], (EOS,), backend, stats)[0] == [X] and stats.masked_rows == 0


def test_check_refuses_a_format_with_length_bounds_which_xgrammar_would_drop(checker):
    schema = {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}}}
    with pytest.raises(InvalidRequest, match=r"properties\.email combines format 'email' with minLength/maxLength"):
        checker.check(json_schema(schema))
    checker.check(json_schema({"type": "object", "properties": {"format": {"type": "string"},
                                                                "maxLength": {"type": "integer"}}}))
