"""The worker's /metrics while its model loads: 200 with the metrics it has, not a 500
(the KV gauges read the loaded model's WorkerInfo, absent until start() returns)."""
from __future__ import annotations

import aiohttp

from protos.radixmesh.v1 import worker_pb2 as pb
from services.common import metrics
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService


async def scrape(service: WorkerService) -> tuple[int, str]:
    runner, port = await metrics.serve(service.registry, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as r:
            return r.status, await r.text()
    finally:
        await runner.cleanup()


async def test_metrics_answer_while_the_model_loads() -> None:
    service = WorkerService(WorkerConfig())  # start() (the model load) has not run
    try:
        status, body = await scrape(service)
        assert status == 200
        assert "radixmesh:worker_steps_total" in body and "radixmesh:kv_pages_total" not in body
        # Loaded: the KV gauges appear.
        service.info = pb.WorkerInfo(model=pb.ModelConfig(name="toy"), num_kv_pages=8, page_size=16)
        service._model = "toy"
        status, body = await scrape(service)
        assert status == 200 and 'radixmesh:kv_pages_total{model_name="toy"} 8.0' in body
    finally:
        service.close()
