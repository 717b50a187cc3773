"""How much one caller may ask for (services/gateway/limits.py): per-key token buckets for
requests and tokens per minute (429 + Retry-After), and the caps on n, stop strings and
max_tokens (400). The buckets with a fake clock; the HTTP answers in-process on aiohttp's
test server with the FakeBackend (one output token per word, usage as the mesh reports it)."""
from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError
from services.gateway.keys import ADMIN_KEY_ENV, API_KEY_ENV
from services.gateway.limits import LIMITER, RateLimiter
from tests.doubles.fake_backend import FakeBackend

KEY_A = "key-a-0123456789abcdef"
KEY_B = "key-b-0123456789abcdef"
COMPLETION = {"model": "fake-model", "prompt": "the quick brown", "max_tokens": 5}


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def serve():
    clients = []

    async def start(backend: FakeBackend | None = None, **config) -> TestClient:
        app = build_app(GatewayConfig(**config), backend or FakeBackend(), monitor_backend=False)
        app[LIMITER].clock = Clock()  # time stands still unless a test moves it
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


async def post(client: TestClient, body: dict, key: str | None = None, path: str = "/v1/completions"):
    r = await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})
    return r.status, r.headers, await r.json()


# --- the buckets ------------------------------------------------------------------------------

def test_requests_per_minute_allow_a_minutes_burst_then_refill_continuously():
    clock = Clock()
    limiter = RateLimiter(rpm=3, tpm=None, clock=clock)
    for _ in range(3):
        limiter.admit("a")
    with pytest.raises(APIError) as e:
        limiter.admit("a")
    assert (e.value.status, e.value.type, e.value.code, e.value.retry_after) == (429, "requests",
                                                                                 "rate_limit_exceeded", 20)
    limiter.admit("b")  # another caller has its own bucket
    clock.now += 19.9
    with pytest.raises(APIError):
        limiter.admit("a")
    clock.now += 0.1  # 3 per minute: one every 20 s
    limiter.admit("a")


def test_tokens_are_charged_after_the_fact_and_may_overdraw():
    clock = Clock()
    limiter = RateLimiter(rpm=None, tpm=600, clock=clock)  # 10 tokens a second
    limiter.admit("a")
    limiter.charge("a", 1500)  # one large request: 900 tokens of debt
    with pytest.raises(APIError) as e:
        limiter.admit("a")
    assert e.value.type == "tokens" and e.value.retry_after == 90
    clock.now += 90.5
    limiter.admit("a")


def test_a_refused_request_takes_nothing_and_full_buckets_are_forgotten():
    clock = Clock()
    limiter = RateLimiter(rpm=1, tpm=10, clock=clock)
    limiter.admit("a")
    limiter.charge("a", 10)
    for _ in range(3):
        with pytest.raises(APIError):
            limiter.admit("a")
    clock.now += 60
    limiter.admit("a")  # refused attempts did not spend the refill
    clock.now += 600
    limiter._forget_full(clock.now)
    assert limiter._buckets == {}


# --- over HTTP --------------------------------------------------------------------------------

async def test_a_key_over_its_request_rate_gets_429_with_retry_after(serve):
    client = await serve(api_key=KEY_A, api_key_file=None, rate_limit_rpm=2)
    for _ in range(2):
        assert (await post(client, COMPLETION, KEY_A))[0] == 200
    status, headers, body = await post(client, COMPLETION, KEY_A)
    assert status == 429 and headers["Retry-After"] == "30"
    assert body["error"]["type"] == "requests" and body["error"]["code"] == "rate_limit_exceeded"
    assert "2 requests per minute for this API key" in body["error"]["message"]
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})).status == 429
    assert (await client.get("/health")).status == 200  # open probes are never limited


async def test_each_key_has_its_own_budget(serve, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    client = await serve(api_key_file=str(keys), rate_limit_rpm=1)
    assert (await post(client, COMPLETION, KEY_A))[0] == 200
    assert (await post(client, COMPLETION, KEY_A))[0] == 429
    assert (await post(client, COMPLETION, KEY_B))[0] == 200
    assert (await post(client, COMPLETION, "key-c-0123456789abcdef"))[0] == 401  # before any limit


async def test_without_keys_the_client_address_is_limited(serve):
    client = await serve(rate_limit_rpm=1)
    assert (await post(client, COMPLETION))[0] == 200
    status, _, body = await post(client, COMPLETION)
    assert status == 429 and "for this client address" in body["error"]["message"]


async def test_tokens_per_minute_count_the_usage_of_whole_and_streamed_requests(serve):
    client = await serve(api_key=KEY_A, rate_limit_tpm=12)
    status, _, body = await post(client, COMPLETION, KEY_A)  # 3 prompt + 5 completion tokens
    assert status == 200 and body["usage"]["total_tokens"] == 8
    r = await client.post("/v1/completions", json={**COMPLETION, "stream": True},
                          headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")  # 8 more: 4 in debt
    status, headers, body = await post(client, COMPLETION, KEY_A)
    assert status == 429 and body["error"]["type"] == "tokens" and headers["Retry-After"] == "20"


async def test_a_request_the_mesh_refuses_costs_no_tokens(serve):
    client = await serve(backend=FakeBackend(queue_full=True), api_key=KEY_A, rate_limit_tpm=1)
    for _ in range(3):
        assert (await post(client, COMPLETION, KEY_A))[0] == 503


# --- caps -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {**COMPLETION, "n": 3}, "n", "n must be at most 2 on this server, got 3"),
    ("/v1/completions", {**COMPLETION, "stop": ["a", "b", "c"]}, "stop", "at most 2 strings on this server, got 3"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 9}, "max_tokens", "max_tokens must be at most 8"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 9}, "max_completion_tokens", "at most 8 on this server"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 4}}, "sampling_params.n", "at most 2"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 100}}, "sampling_params.max_new_tokens",
     "sampling_params.max_new_tokens must be at most 8 on this server, got 100"),
])
async def test_requests_beyond_the_caps_are_400s_naming_the_field(serve, path, body, param, message):
    client = await serve(max_n=2, max_stop=2, max_tokens_limit=8)
    status, _, out = await post(client, body, path=path)
    assert status == 400 and out["error"]["param"] == param and message in out["error"]["message"], out


async def test_the_schemas_own_bounds_still_speak_first(serve):
    client = await serve(max_n=2)
    status, _, out = await post(client, {**COMPLETION, "n": 17})
    assert status == 400 and out["error"]["message"] == "n must be in [1, 16], got 17"


async def test_requests_that_name_no_max_tokens_are_capped_not_refused(serve):
    backend = FakeBackend(context_length=256)
    client = await serve(backend=backend, max_tokens_limit=8)
    status, _, out = await post(client, {"model": "fake-model", "prompt": "the quick"})
    assert status == 200 and out["usage"]["completion_tokens"] <= 8
    assert backend.calls[-1].fill_context and backend.calls[-1].sampling.max_new_tokens == 8
    status, _, out = await post(client, {"text": "hi"}, path="/generate")
    assert status == 200 and backend.calls[-1].sampling.max_new_tokens == 8  # not the core's 128
    roomy = await serve(backend=backend, max_tokens_limit=1000)
    assert (await post(roomy, {"text": "hi"}, path="/generate"))[0] == 200
    assert backend.calls[-1].sampling.max_new_tokens == 128  # /generate's default stays


@pytest.mark.parametrize("config, message", [
    ({"max_n": 17}, "--max-n must be in [1, 16]"), ({"max_n": 0}, "--max-n must be in [1, 16]"),
    ({"max_stop": 17}, "--max-stop must be in [0, 16]"), ({"rate_limit_rpm": 0}, "--rate-limit-rpm must be >= 1"),
    ({"rate_limit_tpm": -5}, "--rate-limit-tpm must be >= 1"), ({"max_tokens_limit": 0}, "--max-tokens-limit"),
    ({"header_timeout_s": 0}, "--header-timeout-s must be > 0"), ({"idle_timeout_s": -1}, "--idle-timeout-s"),
    ({"body_timeout_s": 0}, "--body-timeout-s"), ({"max_connections_per_client": 0}, "--max-connections-per-client"),
])
def test_limit_flags_are_checked(config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        GatewayConfig(**config)
