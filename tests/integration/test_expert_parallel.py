"""Expert parallelism over real processes joined by torch.distributed (--ep-size 2 over a TP 2
group; services/worker/parallel/expert_parallel.py): in float32 a group of two computes the logits
of one process within 1e-4, and the same greedy tokens, on random tiny Qwen3-MoE, Mixtral and
DeepSeek-V3 configurations (DeepSeek's shared experts counted once: each rank runs them on its own
tokens), with and without redundant experts and two-batch overlap; through the Engine,
EPLB rebalancing every few forward passes while several streams run moves expert weights
between the ranks without losing a request or changing a token of transformers' greedy text."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.worker.config import WorkerConfig
from services.worker.group.leader import create_runner
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.expert_load import moe_blocks
from tests.unit.tiny_models import (BATCHES, greedy_continuation, logits_by_position, save_for_generation, save_tiny,
                                    sequences)

pytestmark = pytest.mark.slow
ATOL = 1e-4
ARCHITECTURES = ["qwen3_moe", "mixtral", "deepseek_v3"]
# (ep flags) → what each group is checked with; the plain EP 1 run is the reference.
GROUPS = [dict(), dict(ep_num_redundant_experts=2, enable_two_batch_overlap=True), dict(ep_num_redundant_experts=2)]


def _logits(path: str, **flags) -> tuple[dict, dict]:
    """(logits by position, what the leader's expert-parallel state reports)."""
    config = WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4, **flags)
    runner = create_runner(config, load_checkpoint(path))
    try:
        seqs = sequences("three_chunked")
        logits = logits_by_position(runner, seqs, {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}, 4)
        ep = runner.expert_parallel
        seen = {} if ep is None else {"calls": ep.times.calls, "slots": moe_blocks(runner.model)[0].experts.slots,
                                      "physical": ep.location.phy2log.shape[1]}
        return logits, seen
    finally:
        runner.close()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_ep2_gives_the_logits_and_tokens_of_one_process(tmp_path, name):
    path = save_tiny(tmp_path, name)[0]
    one, _ = _logits(path)
    for flags in GROUPS if name == "qwen3_moe" else GROUPS[:2]:
        group, seen = _logits(path, tp_size=2, ep_size=2, **flags)
        experts = 8 + flags.get("ep_num_redundant_experts", 0)
        assert seen["physical"] == experts and seen["slots"] == experts // 2, seen  # whole experts, half each
        assert seen["calls"] > 0  # the all-to-all dispatch ran
        for rid, rows in one.items():
            for (pos, a), (pos2, b) in zip(rows, group[rid], strict=True):
                assert pos == pos2
                torch.testing.assert_close(b, a, atol=ATOL, rtol=0, msg=lambda m: f"{name} {flags} {rid} @{pos}: {m}")
                assert int(a.argmax()) == int(b.argmax())


def test_live_eplb_rebalances_move_weights_between_ranks_without_changing_a_stream(tmp_path):
    path, hf = save_for_generation(tmp_path, "qwen3_moe")
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 60 - i, 41][: 3 + i] for i in range(4)]
    want = [greedy_continuation(hf, p, 12) for p in prompts]
    # Rebalances every 3 passes, each moving both MoE layers' weights over the next 1-2 passes: several
    # complete within the streams however they batch.
    config = WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, tp_size=2, ep_size=2,
                          ep_num_redundant_experts=2, enable_eplb=True, eplb_rebalance_num_iterations=3,
                          eplb_rebalance_layers_per_chunk=2, eplb_rebalance_weights_per_pass=16)
    engine = Engine(path, worker=config)
    try:
        initial = engine.runner.expert_parallel.location.phy2log.clone()
        results: list = [None] * len(prompts)

        def run(i: int) -> None:  # each its own stream, arriving while the others decode
            results[i] = engine.generate(input_ids=prompts[i], sampling=SamplingParams(
                temperature=0.0, max_new_tokens=12), timeout=300)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stats = engine.runner.expert_parallel.rebalancer.stats
        assert [r.token_ids for r in results] == want
        assert stats.rebalances >= 2 and stats.moved_experts > 0, stats
        assert not torch.equal(engine.runner.expert_parallel.location.phy2log, initial)
    finally:
        engine.shutdown()


def test_expert_parallel_sizes_a_model_cannot_take_are_refused_before_any_rank_starts(tmp_path):
    dense = save_tiny(tmp_path / "dense", "qwen3_mha_untied")[0]
    with pytest.raises(ValueError, match="has no experts"):
        create_runner(WorkerConfig(dtype="float32", tp_size=2, ep_size=2), load_checkpoint(dense))
    moe = save_tiny(tmp_path / "moe", "qwen3_moe")[0]
    with pytest.raises(ValueError, match="does not divide the 8 experts"):
        create_runner(WorkerConfig(dtype="float32", tp_size=2, ep_size=2, ep_num_redundant_experts=1),
                      load_checkpoint(moe))


def test_a_rank_killed_mid_stream_ends_the_streams_with_its_name_and_refuses_new_requests(tmp_path):
    """A follower that dies: the running requests end with an error naming the rank (no hang), and
    the Engine, whose group cannot be reset, refuses what comes next with the same reason."""
    import os
    import signal

    from services.engine.engine import EngineBroken
    path, _ = save_for_generation(tmp_path, "qwen3_moe")
    engine = Engine(path, worker=WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, tp_size=2,
                                              ep_size=2, dist_timeout_s=10))
    try:
        follower = engine.runner.group.followers[0].proc
        stream = threading.Thread(target=lambda: results.append(engine.generate(
            input_ids=[5, 17, 33], sampling=SamplingParams(temperature=0.0, max_new_tokens=400), timeout=60)))
        results: list = []
        stream.start()
        os.kill(follower.pid, signal.SIGKILL)
        stream.join(60)
        assert not stream.is_alive() and results[0].finish_reason.name == "ERROR"
        assert re.search(r"rank(\(s\))? \[?1", results[0].error), results[0].error
        for _ in range(50):  # the driver gives up once its reset fails
            try:
                engine.generate(input_ids=[5, 17], sampling=SamplingParams(max_new_tokens=2), timeout=60)
            except EngineBroken as e:
                assert "worker rank 1" in str(e)
                break
            time.sleep(0.2)
        else:
            pytest.fail("the engine kept accepting requests with a dead rank")
    finally:
        engine.shutdown()
