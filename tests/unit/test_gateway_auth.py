"""Who may call the gateway (services/gateway/auth.py, keys.py): API keys as OpenAI's
`Authorization: Bearer`, the admin key for /admin, open or keyed probes, and the flags through
`radixmesh up`. In-process on aiohttp's test server with the model-free FakeBackend; the
official openai client against a loopback GatewayThread."""
from __future__ import annotations

import argparse
import logging

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.config import config_from_args, flags_from_dataclass
from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.keys import ADMIN_KEY_ENV, API_KEY_ENV
from services.gateway.main import access_warnings, is_loopback
from services.gateway.state import STATE
from services.launcher.up import Mesh, UpConfig, route_flags
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

USER = "user-key-0123456789abcdef"
OTHER = "user-key-fedcba9876543210"
ADMIN = "admin-key-0123456789abcdef"
# The admin routes call the router at --tokenizer-addr: nothing listens on port 1, so an
# admitted admin call fails fast with 503 (not 401/403), which is all these tests need.
NO_ROUTER = "127.0.0.1:1"
COMPLETION = {"model": "fake-model", "prompt": "the quick", "max_tokens": 2}


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


def gateway_config(*argv: str) -> GatewayConfig:
    parser = flags_from_dataclass(GatewayConfig, argparse.ArgumentParser())
    return config_from_args(GatewayConfig, parser.parse_args(list(argv)))


@pytest.fixture
async def serve():
    clients = []

    async def start(**config) -> TestClient:
        cfg = GatewayConfig(tokenizer_addr=NO_ROUTER, **config)
        app = build_app(cfg, FakeBackend(), monitor_backend=False)
        await app[STATE].refresh()
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def status(client: TestClient, method: str, path: str, key: str | None = None, **kw) -> tuple[int, dict]:
    r = await client.request(method, path, headers=bearer(key), **kw)
    body = await r.json() if r.content_type == "application/json" else {}
    return r.status, body


# --- the four answers the issue asks for ---------------------------------------------------

async def test_no_key_is_401_with_openais_envelope_and_a_challenge(serve):
    client = await serve(api_key=USER)
    r = await client.post("/v1/completions", json=COMPLETION)
    body = await r.json()
    assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert body == {"error": {"message": "missing API key: send it as the header `Authorization: Bearer YOUR_KEY`",
                              "type": "invalid_request_error", "param": None, "code": "missing_api_key"}}


@pytest.mark.parametrize("header", [f"Bearer {OTHER}", f"Bearer {USER}x", f"Basic {USER}", USER, "Bearer ",
                                    f"Bearer {USER[:-1]}", "Bearer \u00e9\u00e9\u00e9"])
async def test_a_wrong_key_is_401(serve, header):
    client = await serve(api_key=USER)
    r = await client.post("/v1/completions", json=COMPLETION, headers={"Authorization": header})
    body = await r.json()
    assert r.status == 401 and body["error"]["code"] in ("invalid_api_key", "missing_api_key"), body
    assert USER not in body["error"]["message"]


async def test_a_user_key_on_an_admin_route_is_403(serve):
    client = await serve(api_key=USER, admin_api_key=ADMIN)
    for method, path in [("GET", "/admin/replicas"), ("POST", "/admin/replicas"),
                         ("POST", "/admin/replicas/10.0.0.9:50051/drain"),
                         ("DELETE", "/admin/replicas/10.0.0.9:50051?force=true"), ("POST", "/flush_cache")]:
        code, body = await status(client, method, path, USER, json={"address": "10.0.0.9:50051"})
        assert code == 403 and body["error"]["type"] == "permission_error", (path, body)
        assert body["error"]["code"] == "admin_key_required"
        assert (await status(client, method, path))[0] == 401
        assert (await status(client, method, path, OTHER))[0] == 401
    code, _ = await status(client, "GET", "/admin/replicas", ADMIN)
    assert code == 503  # admitted: the (missing) router answers


async def test_valid_keys_are_served_and_the_admin_key_is_a_user_key_too(serve):
    client = await serve(api_key=USER, admin_api_key=ADMIN)
    for key in (USER, ADMIN):
        code, body = await status(client, "POST", "/v1/completions", key, json=COMPLETION)
        assert code == 200 and body["choices"], body
        assert (await status(client, "GET", "/v1/models", key))[0] == 200
    r = await client.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"bearer   {USER}  "})
    assert r.status == 200  # the scheme in any case, spaces around the key


# --- which routes need which key --------------------------------------------------------------

async def test_user_keys_without_an_admin_key_turn_admin_off(serve):
    client = await serve(api_key=USER)
    code, body = await status(client, "POST", "/admin/replicas", USER, json={"address": "10.0.0.9:1"})
    assert code == 403 and "no --admin-api-key" in body["error"]["message"]
    assert (await status(client, "POST", "/admin/replicas", json={"address": "10.0.0.9:1"}))[0] == 401


async def test_an_admin_key_alone_guards_admin_and_leaves_the_api_open(serve):
    client = await serve(admin_api_key=ADMIN)
    assert (await status(client, "POST", "/v1/completions", json=COMPLETION))[0] == 200
    assert (await status(client, "GET", "/admin/replicas"))[0] == 401
    assert (await status(client, "GET", "/admin/replicas", USER))[0] == 401
    assert (await status(client, "GET", "/admin/replicas", ADMIN))[0] == 503


async def test_without_keys_everything_is_open_as_before(serve):
    client = await serve()
    assert (await status(client, "POST", "/v1/completions", json=COMPLETION))[0] == 200
    assert (await status(client, "GET", "/admin/replicas"))[0] == 503  # reached the (missing) router


async def test_probes_are_open_unless_keyed_by_flag(serve):
    open_ = await serve(api_key=USER)
    for path in ("/health", "/ready", "/metrics"):
        assert (await status(open_, "GET", path))[0] == 200, path
    assert (await status(open_, "GET", "/openapi.json"))[0] == 401  # it names the served model
    assert (await status(open_, "GET", "/nope"))[0] == 401  # no route map for strangers
    keyed = await serve(api_key=USER, probes_need_key=True)
    for path in ("/health", "/ready", "/metrics"):
        assert (await status(keyed, "GET", path))[0] == 401, path
        assert (await status(keyed, "GET", path, USER))[0] == 200, path


async def test_the_document_declares_the_bearer_scheme_only_with_keys(serve):
    plain = await (await (await serve()).get("/openapi.json")).json()
    assert "security" not in plain and "components" not in plain
    client = await serve(api_key=USER)
    doc = await (await client.get("/openapi.json", headers=bearer(USER))).json()
    assert doc["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": "an API key of the gateway (--api-key)"}
    assert doc["security"] == [{"apiKey": []}]
    assert doc["paths"]["/health"]["get"]["security"] == [] and "401" not in doc["paths"]["/health"]["get"]["responses"]
    assert "401" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]


# --- where keys come from --------------------------------------------------------------------

def test_a_key_file_holds_several_keys_with_comments(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# team a\n{USER}\n\n   {OTHER}  \n# {ADMIN} (revoked)\n")
    assert gateway_config("--api-key-file", str(path)).keys() == ((USER, OTHER), ())
    assert gateway_config("--api-key", ADMIN, "--api-key-file", str(path)).keys()[0] == (ADMIN, USER, OTHER)


def test_the_environment_gives_keys_only_when_no_flag_does(monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, f"{USER}, {OTHER}")
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    assert GatewayConfig().keys() == ((USER, OTHER), (ADMIN,))
    assert GatewayConfig(api_key=ADMIN + "-x").keys()[0] == (ADMIN + "-x",)


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "short"], "--api-key: an API key needs at least 16 characters, got 5"),
    (["--api-key", "has a space in it, quite long"], "--api-key: an API key must be printable ASCII"),
    (["--admin-api-key-file", "/nonexistent/keys"], "--admin-api-key-file: cannot read /nonexistent/keys"),
])
def test_bad_keys_are_usage_errors_that_never_show_the_key(argv, message, capsys):
    from services.common.config import parse_config
    with pytest.raises(SystemExit) as exit_:
        parse_config(GatewayConfig, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "quite long" not in err and "short" not in err.replace("got 5", "")


def test_a_key_file_without_keys_or_with_a_bad_line_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        GatewayConfig(api_key_file=str(empty))
    bad = tmp_path / "bad"
    bad.write_text(f"{USER}\ntoo-short\n")
    with pytest.raises(ValueError, match=r"line 2: an API key needs at least 16") as e:
        GatewayConfig(api_key_file=str(bad))
    assert "too-short" not in str(e.value)


def test_a_printed_config_shows_no_key():
    text = repr(GatewayConfig(api_key=USER, admin_api_key=ADMIN))
    assert USER not in text and ADMIN not in text


async def test_refusals_are_logged_without_the_key(serve, caplog):
    client = await serve(api_key=USER)
    with caplog.at_level(logging.DEBUG):
        await status(client, "POST", "/v1/completions", OTHER, json=COMPLETION)
        await status(client, "POST", "/admin/replicas", USER, json={"address": "a:1"})
        await status(client, "POST", "/v1/completions", USER, json=COMPLETION)
    logged = " ".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)
    assert "refused" in logged and USER not in logged and OTHER not in logged


# --- the official client, `radixmesh up`, the start-up warning -------------------------------

def test_the_openai_client_sends_its_key():
    with GatewayThread(FakeBackend(), GatewayConfig(api_key=USER)) as gw:
        good = openai.OpenAI(base_url=gw.url + "/v1", api_key=USER, max_retries=0)
        assert good.models.list().data[0].id == "fake-model"
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=gw.url + "/v1", api_key=OTHER, max_retries=0).models.list()
        assert e.value.code == "invalid_api_key"


def test_radixmesh_up_forwards_the_key_flags_to_the_gateway_only():
    services = ["worker", "detokenizer", "scheduler", "tokenizer", "gateway", "router"]
    argv = ["--api-key", USER, "--admin-api-key-file", "/etc/admin.keys", "--rate-limit-rpm", "60",
            "--max-connections-per-client", "32"]
    routed = route_flags(argv, services)
    assert routed["gateway"] == argv and all(not routed[s] for s in services if s != "gateway")
    mesh = Mesh(UpConfig(replicas=2), routed)
    assert _pairs(mesh._argv("gateway", [])) >= {("--api-key", USER), ("--rate-limit-rpm", "60")}
    parsed = gateway_config(*[a for a in mesh._argv("gateway", []) if a != "/etc/admin.keys"
                              and a != "--admin-api-key-file"])
    assert parsed.keys()[0] == (USER,) and parsed.rate_limit_rpm == 60


def _pairs(argv: list[str]) -> set[tuple[str, str]]:
    return set(zip(argv, argv[1:]))


def test_an_open_gateway_off_loopback_is_warned_about():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("gateway.internal")
    assert access_warnings(GatewayConfig(), False, False) == []
    warning, = access_warnings(GatewayConfig(host="0.0.0.0"), False, False)
    assert "open to anyone who can reach 0.0.0.0" in warning and "/admin too" in warning
    assert access_warnings(GatewayConfig(host="0.0.0.0"), True, False) == []
