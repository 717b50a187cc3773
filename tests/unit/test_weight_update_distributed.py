"""Weight updates over a torch.distributed group (gloo on loopback) from a real trainer process
(services/common/weight_sync.WeightBroadcaster): the runner then serves like a fresh one on the
broadcast weights; a trainer that dies mid-broadcast, or stops sending, fails the update within
the group's timeout with the old weights serving, and a new group can be joined after it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.weight_sync import tensor_metas
from services.worker.weights import WeightUpdateError
from tests.unit.test_weight_update import (assert_serves_like, assert_unchanged, hf_state, runner, save_gguf,
                                           save_hf, snapshot, trace)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # real process groups over gloo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# argv: port, group name, safetensors file of the tensors to send, mode (ok | die | hang)
TRAINER = r"""
import os, sys, time
from safetensors.torch import load_file
from services.common.weight_sync import WeightBroadcaster
port, group, path, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
items = list(load_file(path).items())
sync = WeightBroadcaster("127.0.0.1", port, world_size=2, group_name=group, timeout_s=30)
if mode == "hang":
    time.sleep(3600)  # killed by the test
if mode == "die":
    sync.broadcast(items[:len(items) // 2])
    os._exit(1)
sync.broadcast(items)
sync.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_trainer(port: int, group: str, path: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(port), group, path, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def receive(r, path: str, group: str, mode: str, timeout_s: float = 30.0):
    """A trainer in `mode` sends the tensors of `path`; the runner joins and updates → its report."""
    port = free_port()
    trainer = start_trainer(port, group, path, mode)
    try:
        r.init_weights_update_group("127.0.0.1", port, 1, 2, group, "gloo", timeout_s)
        metas = tensor_metas(load_file(path))
        return r.update_weights_from_distributed([m.name for m in metas], [m.dtype for m in metas],
                                                 [m.shape for m in metas], group)
    finally:
        if mode == "hang":
            trainer.kill()
        out, _ = trainer.communicate(timeout=60)
        assert mode != "ok" or trainer.returncode == 0, out


@pytest.fixture
def weights(tmp_path):
    """(runner on GGUF weights, its logits, bfloat16 HF tensors of other weights in a file, a fresh runner on them)."""
    r = runner(save_gguf(tmp_path, "old", 0))
    new, hf = save_hf(tmp_path, "new", 1)
    path = str(tmp_path / "sent.safetensors")
    save_file(hf_state(hf, torch.bfloat16), path)
    ref = tmp_path / "ref"  # the same tensors as a checkpoint a fresh runner starts from
    ref.mkdir()
    os.link(os.path.join(new, "config.json"), ref / "config.json")
    os.link(path, ref / "model.safetensors")
    return r, trace(r), path, str(ref)


def test_broadcast_serves_like_a_fresh_runner(weights):
    r, before, path, ref = weights
    report = receive(r, path, "rl", "ok")
    assert (report.path, report.version, report.source, r.weights_version) == ("distributed", 1, "rl", 1)
    assert report.bytes == sum(t.numel() * 2 for t in load_file(path).values())
    assert_serves_like(r, runner(ref), before)


def test_trainer_death_mid_broadcast_keeps_the_old_weights_then_a_new_group_works(weights):
    r, before, path, ref = weights
    state = snapshot(r)
    # ended by the closed sockets of the dead trainer (gloo: closed / reset by peer), not by the group's timeout
    with pytest.raises(WeightUpdateError, match="trainer died") as died:
        receive(r, path, "rl", "die")
    assert "timed out" not in str(died.value).lower(), died.value
    assert_unchanged(r, state, before)
    with pytest.raises(WeightUpdateError, match="no weight-update group"):  # the broken group is gone
        r.update_weights_from_distributed([], [], [], "rl")
    assert receive(r, path, "rl", "ok").version == 1
    assert_serves_like(r, runner(ref), before)


def test_a_silent_trainer_fails_the_update_after_the_timeout(weights):
    r, before, path, _ = weights
    state = snapshot(r)
    # the trainer sleeps on (until receive kills it): the group's own 2 s timeout ended the update
    with pytest.raises(WeightUpdateError, match="stopped sending within 2 s.*Timed out waiting 2000ms"):
        receive(r, path, "rl", "hang", timeout_s=2.0)
    assert_unchanged(r, state, before)


def test_refused_broadcast_keeps_the_old_weights_and_the_trainer_completes(tmp_path):
    """Tensors that do not fit arrive in full (the trainer is never left hanging), then are refused."""
    r = runner(save_hf(tmp_path, "old", 0)[0])
    before, state = trace(r), snapshot(r)
    _, hf = save_hf(tmp_path, "wide", 1, intermediate_size=128)
    path = str(tmp_path / "wide.safetensors")
    save_file(hf_state(hf), path)
    with pytest.raises(WeightUpdateError, match="checkpoint shape"):
        receive(r, path, "rl", "ok")
    assert_unchanged(r, state, before)


def test_joining_without_a_trainer_times_out(weights):
    r = weights[0]
    # no trainer ever listens: the join's own 1 s timeout ends it
    with pytest.raises(WeightUpdateError, match="joining weight-update group 'nobody'.*timed out after 1000ms"):
        r.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "nobody", "gloo", 1.0)
    with pytest.raises(WeightUpdateError, match="rank 0 is the trainer"):
        r.init_weights_update_group("127.0.0.1", free_port(), 0, 2, "g", "gloo", 1.0)
