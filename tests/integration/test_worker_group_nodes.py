"""A worker group over two nodes (here two launches on one host, joined over loopback as two
machines would be): node 1 runs `radixmesh serve worker --nnodes 2 --node-rank 1`, node 0's
runner leads. The group's logits equal one rank's (float32, TP 2 × PP 2, two ranks a node), node 1
exits cleanly when the leader stops the group, and a node started with another setting fails
the group on both sides with a message naming the flag."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.group.leader import GroupLost, create_runner
from services.worker.loader.checkpoint import load_checkpoint
from tests.integration.mesh_harness import REPO
from tests.unit.tiny_models import BATCHES, logits_by_position, save_tiny, sequences

pytestmark = pytest.mark.slow

FLAGS = dict(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(path: str, port: int, tp: int, pp: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "worker", "--model", path, "--nnodes", "2", "--node-rank", "1",
         "--tp-size", str(tp), "--pp-size", str(pp), "--dist-init-addr", f"127.0.0.1:{port}", "--dtype", "float32",
         "--page-size", "4", "--kv-cache-bytes", str(4 << 20), "--max-requests", "4", "--num-threads", "1", *extra],
        cwd=REPO, stderr=subprocess.PIPE, text=True)


def _logits(runner) -> dict:
    seqs = sequences("three_chunked")
    return logits_by_position(runner, seqs, {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}, 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny"), "qwen3_moe")[0]


def test_two_nodes_compute_one_ranks_logits_and_node_1_stops_with_the_leader(tiny):
    one = create_runner(WorkerConfig(**FLAGS), load_checkpoint(tiny))
    try:
        want = _logits(one)
    finally:
        one.close()
    port = _port()
    node = _node(tiny, port, 2, 2)
    try:
        leader = create_runner(WorkerConfig(**FLAGS, tp_size=2, pp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}"),
                               load_checkpoint(tiny))
        try:
            got = _logits(leader)
        finally:
            leader.close()
        assert node.wait(30) == 0, node.stderr.read()[-2000:]
    finally:
        node.kill()
    for rid, rows in want.items():
        for (_, a), (_, b) in zip(rows, got[rid], strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_a_node_started_with_another_setting_is_refused_on_both_sides(tiny):
    port = _port()
    node = _node(tiny, port, 2, 1, "--page-size", "8")
    try:
        with pytest.raises(ValueError, match=r"different settings; rank 1: page_size 8 \(rank 0: 4\)"):
            create_runner(WorkerConfig(**FLAGS, tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}"),
                          load_checkpoint(tiny))
        assert node.wait(30) != 0
        assert "page_size 8 (rank 0: 4)" in node.stderr.read()
    finally:
        node.kill()


def test_a_dead_node_fails_the_leaders_next_command_and_reports_the_group_lost(tiny):
    """The watchdog sees the leader's own followers only: a node gone is found by the next command
    the leader sends, which fails at once (gloo sees the connection closed) and reports the group
    lost (on_lost: the worker service exits, so its health and its container's restart follow)."""
    port = _port()
    node = _node(tiny, port, 1, 2)
    lost = []
    leader = create_runner(WorkerConfig(**FLAGS, pp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}"),
                           load_checkpoint(tiny), on_lost=lost.append)
    try:
        node.kill()
        node.wait(30)
        with pytest.raises(GroupLost, match="a node of the worker group is gone"):
            leader.reset()
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lost) == 1 and "a node of the worker group is gone" in lost[0], lost
        with pytest.raises(GroupLost):  # broken for good, reported once
            leader.reset()
        time.sleep(0.2)
        assert len(lost) == 1
    finally:
        leader.close()
        node.kill()


def test_several_nodes_need_a_rendezvous_address_and_an_even_split():
    with pytest.raises(ValueError, match="--nnodes > 1 needs --dist-init-addr"):
        WorkerConfig(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="do not split evenly over --nnodes 2"):
        WorkerConfig(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1")
