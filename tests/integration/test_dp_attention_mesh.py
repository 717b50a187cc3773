"""Data-parallel attention through the real mesh: `radixmesh up --enable-dp-attention --dp-size 2
--tp-size 2 --ep-size 2` on a random tiny DeepSeek-V3 starts one worker group and a scheduler,
detokenizer and tokenizer per rank behind the router. Concurrent greedy requests through the router
are spread over both ranks' schedulers (the router's cache_aware policy) and stream transformers'
greedy text; a prompt sent again goes to the rank that cached it; both ranks' steps are traced."""
from __future__ import annotations

import re
import threading
import time

import pytest

from protos.radixmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tests.integration.mesh_harness import Mesh, collect, greedy, otlp_env
from tests.integration.otlp_receiver import Receiver
from tests.unit.tiny_models import greedy_continuation, save_for_generation

pytestmark = pytest.mark.slow
N_NEW = 8


def test_the_router_spreads_requests_over_the_ranks_schedulers(tmp_path):
    path, hf = save_for_generation(tmp_path, "deepseek_v3")
    prompts = [[(7 * i + 3 * j + 1) % 256 for j in range(20)] for i in range(6)]  # past a 16-token page
    receiver = Receiver().__enter__()
    mesh = Mesh("--model", path, "--dtype", "float32", "--kv-cache-bytes", str(4 << 20), "--max-requests", "4",
                "--max-running-requests", "4", "--tp-size", "2", "--ep-size", "2", "--dp-size", "2",
                "--enable-dp-attention", "--check-invariants",  # the router's default policy: cache_aware
                env=otlp_env(receiver.endpoint))
    try:
        expected = [greedy_continuation(hf, p, N_NEW) for p in prompts]  # while the mesh starts
        mesh.wait_ready(timeout=300)
        assert {"worker", "scheduler-dp0", "scheduler-dp1", "tokenizer-dp0", "tokenizer-dp1", "router"} <= set(
            mesh.addresses)
        router = tokenizer_pb2_grpc.TokenizerStub(mesh.channel("router"))
        got: dict[int, list[int]] = {}

        def run(i: int) -> None:
            text = " ".join(f"t{t}" for t in prompts[i])
            seqs = collect(router.Generate(tokenizer_pb2.GenerateTextRequest(text=text, sampling=greedy(N_NEW)),
                                           timeout=120))
            got[i] = [int(m) for m in re.findall(r"t(\d+)", seqs[0]["text"])]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [got.get(i) for i in range(len(prompts))] == expected
        finished = [scheduler_pb2_grpc.SchedulerStub(mesh.channel(f"scheduler-dp{r}")).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10).finished for r in range(2)]
        assert sum(finished) == len(prompts) and min(finished) > 0, finished  # both ranks served
        run(0)  # again, alone: the router sends it where its prefix is cached
        assert got[0] == expected[0]
        hits = [scheduler_pb2_grpc.SchedulerStub(mesh.channel(f"scheduler-dp{r}")).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10).cache_hits for r in range(2)]
        assert sum(hits) >= 1, hits
        # Every step is traced: worker.step spans from both ranks' rounds, linked to the requests they served
        deadline = time.monotonic() + 20
        while {s.attributes.get("radixmesh.dp_rank") for s in receiver.spans() if s.name == "worker.step"} != {0, 1}:
            assert time.monotonic() < deadline, "worker.step spans of both ranks did not arrive"
            time.sleep(0.5)
        steps = [s for s in receiver.spans() if s.name == "worker.step"]
        assert all(s.parent_id == "" and s.attributes["radixmesh.forward_seconds"] >= 0 for s in steps)
        assert sum(bool(s.links) for s in steps) >= len(prompts)
        assert mesh.stop() == 0
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()
        receiver.__exit__(None, None, None)
