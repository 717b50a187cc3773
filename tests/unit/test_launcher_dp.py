"""`radixmesh up --enable-dp-attention --dp-size N`: the plan is one worker group and, per rank, a
scheduler (--dp-rank r on the one worker), detokenizer and tokenizer, behind the router."""
from __future__ import annotations

import os

import pytest

from services.launcher.up import dp_lanes, plan
from services.worker.group.leader import rank_config
from services.worker.config import WorkerConfig


def test_the_dp_plan_gives_each_rank_its_scheduler_on_the_one_worker():
    planned = {p.name: p for p in plan(1, False, True, dp=2)}
    assert list(planned) == ["worker", "scheduler-dp0", "detokenizer-dp0", "tokenizer-dp0", "scheduler-dp1",
                             "detokenizer-dp1", "tokenizer-dp1", "router", "gateway"]
    for r in (0, 1):
        sched = planned[f"scheduler-dp{r}"]
        assert sched.peers == [("--worker-addr", ["worker"])] and sched.flags == ("--dp-rank", str(r))
        assert planned[f"tokenizer-dp{r}"].peers == [("--scheduler-addr", [f"scheduler-dp{r}"]),
                                                     ("--detokenizer-addr", [f"detokenizer-dp{r}"])]
    assert planned["router"].peers == [("--replica-addrs", ["tokenizer-dp0", "tokenizer-dp1"])]
    assert planned["gateway"].peers == [("--tokenizer-addr", ["router"])]


@pytest.mark.parametrize("extra,lanes", [(["--dp-size", "2"], 1), (["--enable-dp-attention", "--dp-size", "3"], 3),
                                         (["--enable-dp-attention", "--dp-size=2"], 2), (["--tp-size", "2"], 1)])
def test_the_launcher_reads_the_ranks_from_the_worker_flags(extra, lanes):
    assert dp_lanes(extra) == lanes


def test_dp_attention_is_one_worker_group_not_replicas():
    with pytest.raises(ValueError, match="one worker group"):
        plan(2, False, True, dp=2)


def test_a_group_rank_takes_no_lead_cpu():
    """radixmesh up gives a one-replica worker --lead-cpu; each rank of a group has CPUs of its own
    instead (a rank pinned to one CPU refused the lead CPU, and the group failed to start)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("a lead CPU needs 2 CPUs")
    config = WorkerConfig(tp_size=2, lead_cpu=cpus[-1])
    assert config.lead_cpu == cpus[-1] and rank_config(config, (cpus[-1],), 1).lead_cpu is None
