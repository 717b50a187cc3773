"""Fuzz the gateway with API keys on: its /openapi.json then declares the bearer scheme, and
schemathesis sends the key with every case (a few schema-valid and schema-invalid bodies per
operation; its ignored_auth check resends each without the key and with a wrong one and wants
them refused). Beside it, hypothesis throws arbitrary Authorization headers (and junk header
lines) at the raw socket. Nothing may answer 5xx, a request without the key gets 401, and the
gateway keeps serving. FakeBackend behind a loopback GatewayThread, as test_gateway_fuzz.py."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.parameters import ParameterLocation

from services.gateway.auth import is_admin_path
from services.gateway.config import GatewayConfig
from services.gateway.openapi import document
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

KEY = "fuzz-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = 8
SCHEMA = schemathesis.openapi.from_dict(document("fake-model", api_keys=True))
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations()]
CASES = [(op, mode) for op in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode == GenerationMode.POSITIVE or op.method.upper() == "POST"]
OPEN = {"/health", "/ready"}


@pytest.fixture(scope="module")
def gateway():
    with GatewayThread(FakeBackend(), GatewayConfig(api_key=KEY)) as gw:
        yield gw


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_served_document_is_the_fuzzed_one(gateway):
    status, body = get(gateway.url + "/openapi.json", AUTH)
    assert status == 200 and json.loads(body) == document("fake-model", api_keys=True)


@pytest.mark.parametrize("op,mode", CASES, ids=[f"{op.method.upper()} {op.path} {mode.value}" for op, mode in CASES])
def test_fuzz_operation_with_the_key(gateway, op, mode):
    statuses: dict[int, int] = {}  # of the cases whose body broke the schema

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call_and_validate(base_url=gateway.url, headers=AUTH, timeout=30,
                                          excluded_checks=[schemathesis.checks.positive_data_acceptance])
        assert response.status_code < 500 or (op.path == "/ready" and response.status_code == 503), response.text
        if mode == GenerationMode.POSITIVE or body_broke_the_schema(case):
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    if is_admin_path(op.path):  # the gateway has no --admin-api-key: a user key is refused before any check
        assert set(statuses) <= ({401, 403} if mode == GenerationMode.NEGATIVE else {403}), statuses
    elif mode == GenerationMode.NEGATIVE:  # 401: the case's Authorization header was made invalid too
        assert set(statuses) <= {400, 401, 404, 405, 413}, statuses
    else:
        assert 401 not in statuses, statuses  # the key was accepted throughout


def body_broke_the_schema(case) -> bool:
    """A negative case may break only its Authorization header, which the test's own key then
    replaces: such a case is a valid request, and a 200 is its right answer."""
    body = case.meta.components.get(ParameterLocation.BODY) if case.meta else None
    return body is not None and body.mode == GenerationMode.NEGATIVE


@pytest.mark.parametrize("op", OPERATIONS, ids=[f"{op.method.upper()} {op.path}" for op in OPERATIONS])
def test_without_the_key_every_operation_but_the_probes_is_401(gateway, op):
    path = op.path.replace("{model}", "fake-model")
    request = urllib.request.Request(gateway.url + path, method=op.method.upper(),
                                     data=b"{}" if op.method.upper() == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    if op.path in OPEN:
        assert status in (200, 503)
    else:
        assert status == 401 and json.loads(body)["error"]["code"] == "missing_api_key"


def raw_request(url: str, header_lines: list[bytes], body: bytes = b"{}") -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
                  + b"".join(line + b"\r\n" for line in header_lines)
                  + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


header_value = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@given(value=header_value, junk=st.lists(st.tuples(st.binary(min_size=1, max_size=20), header_value), max_size=3))
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_arbitrary_authorization_headers_are_refused_never_crash(gateway, value, junk):
    lines = [b"Authorization: " + value] + [
        name.replace(b"\r", b"").replace(b"\n", b"").replace(b":", b"") + b": " + v for name, v in junk]
    answer = raw_request(gateway.url, lines)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")) else None
    assert status in (400, 401), answer[:300]  # 400: a header aiohttp's parser rejects


def test_the_gateway_still_serves_after_the_fuzzing(gateway):
    assert get(gateway.url + "/health")[0] == 200
    assert get(gateway.url + "/v1/models", AUTH)[0] == 200
