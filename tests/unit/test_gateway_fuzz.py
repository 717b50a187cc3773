"""Fuzz the gateway from its own /openapi.json (schemathesis), FakeBackend behind it.

Per operation, 30 schema-valid and 30 schema-invalid requests (bounded, no
shrinking, no example database). Every response must conform to the document
(status codes, content types, JSON and SSE schemas), no 5xx, invalid data is
rejected with a 4xx, and each call returns within its timeout. Schema-valid
requests may still be refused (400) for rules a schema cannot state, such as
min_tokens <= max_tokens or the context length, so `positive_data_acceptance`
is not among the checks.
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any, Callable

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from services.gateway.openapi import document
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

MAX_EXAMPLES = 30
SCHEMA = schemathesis.openapi.from_dict(document("fake-model"))
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations()]
CASES = [(op, mode) for op in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode == GenerationMode.POSITIVE or op.method.upper() == "POST"]


@pytest.fixture(scope="module")
def gateway():
    # Speculating (unless a case says speculative=false), so usage.speculative is checked too.
    with GatewayThread(FakeBackend(draft_tokens=3)) as gw:
        yield gw


def test_the_served_document_is_the_fuzzed_one(gateway):
    with urllib.request.urlopen(gateway.url + "/openapi.json", timeout=10) as r:
        assert json.load(r) == document("fake-model")


def fuzz(gateway_url: str, op, mode: GenerationMode, max_examples: int = MAX_EXAMPLES,
         prepare: Callable[[Any], Any] | None = None) -> dict[int, int]:
    """Run one operation's cases; returns a histogram of statuses. Raises on a failed check.
    `prepare` may shrink a schema-valid body (positive mode only: a negative case must stay invalid)."""
    statuses: dict[int, int] = {}

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case):
        if prepare is not None and mode == GenerationMode.POSITIVE and op.method.upper() == "POST":
            case.body = prepare(case.body)
        response = case.call_and_validate(base_url=gateway_url, timeout=30,
                                          excluded_checks=[schemathesis.checks.positive_data_acceptance])
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, response.text

    run()
    return statuses


@pytest.mark.parametrize("op,mode", CASES, ids=[f"{op.method.upper()} {op.path} {mode.value}" for op, mode in CASES])
def test_fuzz_operation(gateway, op, mode):
    statuses = fuzz(gateway.url, op, mode)
    if mode == GenerationMode.NEGATIVE:
        assert set(statuses) <= {400, 404, 405, 413}, statuses
    elif op.path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"):
        assert statuses.get(200, 0) > 0, statuses  # the generator reaches the backend, not only validation
