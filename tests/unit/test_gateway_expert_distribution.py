"""The expert distribution routes of the gateway (services/gateway/model_admin.py), in process on
aiohttp's test server: the backend's ModelAdmin is a WorkerAdmin over a tiny random Qwen3-MoE
runner (the gRPC stages between only pass the call on), so a start over HTTP, a step, a stop and
a dump answer the recorder's counts as ExpertDump's JSON, which --init-expert-location loads.
SGLang's route names do the same; only the admin key gets in; refusals use the envelope."""
from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.admin_error import AdminError
from services.gateway.app import build_app
from services.gateway.backend import BackendError
from services.gateway.config import GatewayConfig
from services.gateway.keys import ADMIN_KEY_ENV, API_KEY_ENV
from services.gateway.state import STATE
from services.worker.admin import WorkerAdmin
from services.worker.model.expert_load import ExpertDump
from tests.doubles.fake_backend import FakeBackend
from tests.unit.tiny_models import MOE, logits_by_position, runner, save_tiny

ADMIN, USER = "admin-key-0123456789abcdef", "user-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


class AdminBackend(FakeBackend):
    """FakeBackend whose ModelAdmin is a worker's, errors as the gRPC stages pass them up."""

    def __init__(self, runner_) -> None:
        super().__init__()
        self.worker = WorkerAdmin(runner_)

    async def admin(self, method: str, request):
        try:
            return self.worker.handle(method, request)
        except AdminError as e:
            raise BackendError(e.status_code.name, e.message) from None


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return runner(save_tiny(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")[0])


@pytest.fixture
async def gateway(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    clients = []

    async def start(backend) -> TestClient:
        app = build_app(GatewayConfig(api_key=USER, admin_api_key=ADMIN), backend, monitor_backend=False)
        await app[STATE].refresh()
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


async def call(client: TestClient, method: str, path: str, headers=AUTH, **kw) -> tuple[int, dict]:
    r = await client.request(method, path, headers=headers, **kw)
    return r.status, await r.json()


async def test_record_over_http(gateway, moe, tmp_path):
    client = await gateway(AdminBackend(moe))
    status, body = await call(client, "GET", "/admin/expert_distribution/dump")
    assert status == 400 and "start a recording first" in body["error"]["message"]
    status, body = await call(client, "POST", "/admin/expert_distribution/start")
    assert status == 200 and body["recording"] and body["logical_count"] == [[0] * MOE["num_experts"]] * 2
    logits_by_position(moe, {"a": list(range(1, 9))}, {"a": [8]}, 4)  # 8 tokens, one step
    status, stopped = await call(client, "POST", "/admin/expert_distribution/stop")
    assert status == 200 and not stopped["recording"]
    assert [sum(row) for row in stopped["logical_count"]] == [8 * MOE["num_experts_per_tok"]] * 2
    status, dump = await call(client, "GET", "/admin/expert_distribution/dump")
    assert status == 200 and dump["logical_count"] == stopped["logical_count"] and dump["forwards"] == 1
    assert set(dump) == {"layers", "logical_count", "forwards", "seconds", "recording"}
    saved = tmp_path / "experts.json"
    saved.write_bytes(await (await client.get("/admin/expert_distribution/dump", headers=AUTH)).read())
    assert ExpertDump.load(str(saved)).logical_count == dump["logical_count"]


async def test_sglang_names_and_refusals(gateway, moe):
    client = await gateway(AdminBackend(moe))
    status, body = await call(client, "POST", "/start_expert_distribution_record")
    assert status == 200 and body["recording"] and body["forwards"] == 0
    assert (await call(client, "POST", "/stop_expert_distribution_record"))[1]["recording"] is False
    status, body = await call(client, "POST", "/dump_expert_distribution_record")
    assert status == 200 and body["layers"] == [0, 1]
    for path in ("/admin/expert_distribution/start", "/start_expert_distribution_record"):
        assert (await call(client, "POST", path, headers={}))[0] == 401
        status, body = await call(client, "POST", path, headers={"Authorization": f"Bearer {USER}"})
        assert status == 403 and body["error"]["code"] == "admin_key_required"
    status, body = await call(client, "POST", "/admin/expert_distribution/start", json={"layers": 2})
    assert status == 400 and body["error"]["param"] == "layers"
    assert (await call(client, "POST", "/admin/expert_distribution/dump"))[0] == 405  # a GET


async def test_a_dense_model_or_no_admin_is_refused(gateway, tmp_path):
    dense = await gateway(AdminBackend(runner(save_tiny(tmp_path, "qwen3_mha_untied")[0])))
    status, body = await call(dense, "POST", "/admin/expert_distribution/start")
    assert status == 400 and "has no experts" in body["error"]["message"]
    assert body["error"]["code"] == "failed_precondition"
    status, body = await call(await gateway(FakeBackend()), "GET", "/admin/expert_distribution/dump")
    assert status == 404 and "no model administration" in body["error"]["message"]
