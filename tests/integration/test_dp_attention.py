"""Data-parallel attention (--enable-dp-attention --dp-size 2, services/worker/parallel/dp_attention.py)
over real processes joined by torch.distributed, on a random tiny DeepSeek-V3: each rank runs its
own requests' attention over its own latent KV, the MoE layers gather every rank's tokens, run
expert-parallel (EP 2) or tensor-parallel, and scatter them back. In float32 every rank's logits
equal those of one process holding all the requests; a rank with nothing to do beside a busy one
runs its idle pass and nothing hangs; a rank killed mid-stream fails the group's next step with
an error naming it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.group.leader import GroupLost, create_runner
from services.worker.loader.checkpoint import load_checkpoint
from tests.unit.tiny_models import (BATCHES, greedy_continuation, logits_by_position, pages, save_for_generation,
                                    save_tiny, sequences)

pytestmark = pytest.mark.slow
ATOL = 1e-4
CHUNKS = {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}
RANKS = {0: ["a", "c"], 1: ["b"]}  # each rank's requests: rank 1's one ends first, then it idles


def _config(**flags) -> WorkerConfig:
    return WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4, **flags)


def _dp_logits(runner, seqs: dict[str, list[int]]) -> dict:
    """logits_by_position for a DP group: each rank's requests in its own plans, every step a round
    of both ranks' plans (None once a rank has nothing left) → rid → [(position, logits row)]."""
    sp = SamplingParams(temperature=0.0)
    tables = {r: pages({rid: seqs[rid] for rid in rids}, 4) for r, rids in RANKS.items()}
    pos = {rid: 0 for rid in seqs}
    todo = {rid: list(CHUNKS[rid]) for rid in seqs}
    ours: dict[str, list] = {rid: [] for rid in seqs}
    runner.execute_round([StepPlan(0, [NewRequestSpec(rid, seqs[rid], [], sp, 0) for rid in rids])
                          for rids in RANKS.values()], "compute_logits")
    step = 1
    while any(pos[r] < len(s) for r, s in seqs.items()):
        plans = []
        for r, rids in RANKS.items():
            items = []
            for rid in rids:
                if pos[rid] < len(seqs[rid]):
                    n, first = (todo[rid].pop(0) if todo[rid] else 1), pos[rid] == 0
                    items.append(StepItem(rid, seqs[rid][pos[rid]:pos[rid] + n], pos[rid],
                                          tables[r][rid] if first else [], first))
            plans.append(StepPlan(step, [], items) if items else None)
        for plan, out in zip(plans, runner.execute_round(plans, "compute_logits"), strict=True):
            if plan is None:
                assert out is None
                continue
            logits, sampled = out
            for i, row in zip(sampled, logits):
                item = plan.items[i]
                ours[item.rid].append((item.start_pos + len(item.input_ids) - 1, row))
                pos[item.rid] += len(item.input_ids)
        step += 1
    return ours


@pytest.mark.parametrize("flags", [dict(ep_size=2), dict()], ids=["ep2", "moe_tp2"])
def test_dp_attention_2_gives_every_rank_the_logits_of_one_process(tmp_path, flags):
    path = save_tiny(tmp_path, "deepseek_v3")[0]
    seqs = sequences("three_chunked")
    one = logits_by_position(create_runner(_config(), load_checkpoint(path)), seqs, CHUNKS, 4)
    runner = create_runner(_config(tp_size=2, dp_size=2, enable_dp_attention=True, **flags), load_checkpoint(path))
    try:
        assert runner.dp_size == 2 and runner.model.dp_tokens is not None
        assert runner.kv_spec.is_latent and runner.model.config.num_attention_heads == 4  # attention whole
        group = _dp_logits(runner, seqs)
    finally:
        runner.close()
    for rid, rows in one.items():
        assert [p for p, _ in rows] == [p for p, _ in group[rid]]
        for (pos, a), (_, b) in zip(rows, group[rid], strict=True):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0, msg=lambda m: f"{flags} {rid} @{pos}: {m}")
            assert int(a.argmax()) == int(b.argmax())


def test_the_engine_spreads_requests_over_the_ranks_and_streams_transformers_greedy_text(tmp_path):
    """Each rank's scheduler takes its share of a batch (cache-aware), a request alone leaves the other
    rank idle beside it (its idle pass in every step: nothing hangs), a repeated prefix follows its
    rank, and every text is transformers'."""
    path, hf = save_for_generation(tmp_path, "deepseek_v3")
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 60 - i, 41][: 3 + i] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    engine = Engine(path, worker=WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, tp_size=2,
                                              ep_size=2, dp_size=2, enable_dp_attention=True))
    try:
        outs = engine.generate_batch(prompts, sp)
        assert [o.token_ids for o in outs] == [greedy_continuation(hf, p, 10) for p in prompts]
        assert sorted(set(engine._lanes.picked)) == [0, 1]  # both ranks took requests
        shared = [7, 8, 9, 10, 11, 12, 13, 14]
        first = engine.generate(input_ids=shared, sampling=sp, timeout=300)  # alone: the other rank idles
        again = engine.generate(input_ids=shared + [3], sampling=sp, timeout=300)
        assert engine._lanes.picked[-1] == engine._lanes.picked[-2]  # the prefix's rank again
        assert first.token_ids == greedy_continuation(hf, shared, 10)
        assert again.token_ids == greedy_continuation(hf, shared + [3], 10)
        assert engine._rounds.rounds > 0
    finally:
        engine.shutdown()


def test_a_rank_killed_mid_stream_fails_the_next_round_naming_it(tmp_path):
    path = save_tiny(tmp_path, "deepseek_v3")[0]
    runner = create_runner(_config(tp_size=2, dp_size=2, ep_size=2, enable_dp_attention=True, dist_timeout_s=5.0),
                           load_checkpoint(path))
    follower = runner.group.followers[0].proc
    sp = SamplingParams(temperature=0.0)
    try:
        runner.execute_round([StepPlan(0, [NewRequestSpec("a", [1, 2, 3], [], sp, 0)]),
                              StepPlan(0, [NewRequestSpec("b", [4, 5], [], sp, 0)])])
        runner.execute_round([StepPlan(1, [], [StepItem("a", [1, 2, 3], 0, [0], True)]),
                              StepPlan(1, [], [StepItem("b", [4, 5], 0, [0], True)])])
        os.kill(follower.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(GroupLost, match="worker rank 1 .* exited"):
            runner.execute_round([StepPlan(2, [], [StepItem("a", [7], 3, [])]), None])
        assert time.monotonic() - started < 5.0 + 5.0
        with pytest.raises(GroupLost, match="worker rank 1"):  # named from then on
            runner.execute_round([StepPlan(3, [], [StepItem("a", [8], 4, [])]), None])
    finally:
        runner.close()


def test_radixmesh_generate_takes_the_dp_attention_flags(tmp_path):
    """The same flags on the CLI: `radixmesh generate` over DP attention 2 x EP 2 prints transformers' greedy text."""
    import json
    import re
    import subprocess
    import sys
    path, hf = save_for_generation(tmp_path, "deepseek_v3")
    prompt_ids, n_new = sequences("two")["a"][:12], 8
    cmd = [sys.executable, "-m", "services.cli", "generate", "--model", path, "--dtype", "float32",
           "--kv-cache-bytes", str(8 << 20), "--tp-size", "2", "--ep-size", "2", "--dp-size", "2",
           "--enable-dp-attention", "--max-new-tokens", str(n_new), "--temperature", "0", "--json",
           " ".join(f"t{i}" for i in prompt_ids)]
    done = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [int(m) for m in re.findall(r"t(\d+)", out["text"])] == greedy_continuation(hf, prompt_ids, n_new)


def test_a_rank_killed_while_the_engine_streams_ends_every_request_with_an_error_naming_it(tmp_path):
    """Both ranks decode long requests; rank 1's process is killed: every open request, on either
    rank, ends with an error that names the rank, within seconds, and new requests are refused."""
    from services.common.outputs import FinishReason
    from services.engine.engine import EngineBroken
    path, _ = save_for_generation(tmp_path, "deepseek_v3")
    engine = Engine(path, worker=WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, tp_size=2,
                                              ep_size=2, dp_size=2, enable_dp_attention=True, dist_timeout_s=5.0))
    try:
        import queue as queue_mod
        outs: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        sp = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
        for i in range(4):
            engine.submit([5 + i, 17, 33, 9 + i], sp, outs.put, rid=f"r{i}")
        first = outs.get(timeout=120)  # streaming has begun
        assert not first.finish_reason
        os.kill(engine.runner.group.followers[0].proc.pid, signal.SIGKILL)
        started, errors = time.monotonic(), {}
        while len(errors) < 4:
            out = outs.get(timeout=30)
            if out.finish_reason is FinishReason.ERROR:
                errors[out.rid] = out.error
        assert time.monotonic() - started < 20
        assert all("worker rank 1" in e for e in errors.values()), errors
        with pytest.raises(EngineBroken, match="worker rank 1"):
            engine.submit([1, 2, 3], sp, outs.put)
    finally:
        engine.shutdown()


def test_the_engine_flushes_every_ranks_cache(tmp_path):
    path, _ = save_for_generation(tmp_path, "deepseek_v3")
    engine = Engine(path, worker=WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, tp_size=2,
                                              ep_size=2, dp_size=2, enable_dp_attention=True))
    try:
        sp = SamplingParams(temperature=0.0, max_new_tokens=4)
        engine.generate_batch([[(5 * i + j) % 256 for j in range(40)] for i in range(4)], sp)  # a page or more each
        assert sorted(set(engine._lanes.picked)) == [0, 1]
        cached = [lane.scheduler.kv.cache.cached_pages for lane in engine._lanes.lanes]
        assert min(cached) > 0, cached
        assert engine.flush_cache() == sum(cached)
        assert [lane.scheduler.kv.cache.cached_pages for lane in engine._lanes.lanes] == [0, 0]
    finally:
        engine.shutdown()
