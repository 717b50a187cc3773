"""The expert distribution recorder through model administration (SGLang's start / stop / dump):
the worker's ModelAdmin share on a tiny random Qwen3-MoE (every MoE layer's row adds up to the
tokens run x num_experts_per_tok, only while recording), the refusals (a dense model, a dump
before any start, no action), the one proto <-> JSON conversion (the gateway's body is a file
--init-expert-location loads), a router's replicas added up, the Engine's call, and every stage
of the ModelAdmin contract serving the RPC."""
from __future__ import annotations

import json

import pytest

from protos.radixmesh.v1 import admin_pb2 as apb
from services.common import expert_distribution as ed
from services.common.admin_error import FAILED_PRECONDITION, INVALID_ARGUMENT, AdminError
from services.common.admin_forward import METHODS
from services.gateway.model_admin import distribution_body
from services.worker.admin import WorkerAdmin
from services.worker.model.expert_load import ExpertDump
from tests.unit.tiny_models import MOE, logits_by_position, runner, save_tiny

K = MOE["num_experts_per_tok"]
SEQS = {"a": list(range(1, 12)), "b": list(range(40, 46))}  # 17 tokens, one step each
CHUNKS = {"a": [11], "b": [6]}
RUN_TOKENS = sum(map(len, SEQS.values()))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path, _ = save_tiny(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    return runner(path)


def act(runner_, action: int) -> apb.ExpertDistribution:
    state = WorkerAdmin(runner_).handle("ExpertDistribution", apb.ExpertDistributionRequest(action=action))
    assert state.model == runner_.model_config.name
    return state.expert_distribution


def run_tokens(runner_) -> None:
    """RUN_TOKENS tokens through the model in one step (the same rids again replace the last run's)."""
    logits_by_position(runner_, SEQS, CHUNKS, 4)


def sums(d: apb.ExpertDistribution) -> list[int]:
    return [sum(row.counts) for row in d.logical_count]


def test_a_recording_counts_only_between_start_and_stop(moe):
    before = act(moe, apb.EXPERT_DISTRIBUTION_START)
    assert before.recording and list(before.layers) == [0, 1] and sums(before) == [0, 0]
    assert [len(row.counts) for row in before.logical_count] == [MOE["num_experts"]] * 2
    run_tokens(moe)
    during = act(moe, apb.EXPERT_DISTRIBUTION_DUMP)
    assert during.recording and sums(during) == [RUN_TOKENS * K] * 2 and during.forwards == 1
    stopped = act(moe, apb.EXPERT_DISTRIBUTION_STOP)
    assert not stopped.recording and stopped.logical_count == during.logical_count
    run_tokens(moe)  # not recorded, but counted in the total (/metrics)
    after = act(moe, apb.EXPERT_DISTRIBUTION_DUMP)
    assert not after.recording and after.logical_count == during.logical_count and after.forwards == 1
    assert after.seconds >= stopped.seconds >= during.seconds > 0
    assert act(moe, apb.EXPERT_DISTRIBUTION_STOP).logical_count == during.logical_count  # a second stop: no-op
    restarted = act(moe, apb.EXPERT_DISTRIBUTION_START)
    assert restarted.recording and sums(restarted) == [0, 0] and restarted.forwards == 0
    act(moe, apb.EXPERT_DISTRIBUTION_STOP)


def test_refusals_say_why(tmp_path, moe):
    moe.expert_load.recording = moe.expert_load.recorded = None  # as loaded: nothing recorded yet
    for action in (apb.EXPERT_DISTRIBUTION_DUMP, apb.EXPERT_DISTRIBUTION_STOP):
        with pytest.raises(AdminError, match="start a recording first") as e:
            act(moe, action)
        assert e.value.code == FAILED_PRECONDITION
    with pytest.raises(AdminError, match="start, stop or dump") as e:
        act(moe, apb.EXPERT_DISTRIBUTION_ACTION_UNSPECIFIED)
    assert e.value.code == INVALID_ARGUMENT
    dense = runner(save_tiny(tmp_path, "qwen3_mha_untied")[0])
    assert dense.expert_load is None
    with pytest.raises(AdminError, match="has no experts") as e:
        act(dense, apb.EXPERT_DISTRIBUTION_START)
    assert e.value.code == FAILED_PRECONDITION


def test_the_dump_json_is_an_init_expert_location_file(tmp_path, moe):
    act(moe, apb.EXPERT_DISTRIBUTION_START)
    run_tokens(moe)
    msg = act(moe, apb.EXPERT_DISTRIBUTION_STOP)
    dump = moe.expert_load.dump()
    dump.seconds = msg.seconds  # a dump's seconds are its own time of asking
    assert ed.to_proto(dump) == msg
    assert ExpertDump(**ed.to_dict(msg)) == dump
    body = distribution_body(apb.ModelState(expert_distribution=msg))  # the gateway's answer, one replica
    assert json.loads(dump.to_json()) == body
    saved = tmp_path / "experts.json"
    saved.write_text(json.dumps(body))
    assert ExpertDump.load(str(saved)) == dump


def test_behind_a_router_the_replicas_add_up(tmp_path):
    one = ExpertDump([0, 2], [[1, 2, 0], [3, 0, 0]], forwards=4, seconds=2.0, recording=False)
    two = ExpertDump([0, 2], [[0, 5, 1], [1, 1, 1]], forwards=3, seconds=3.0, recording=True)
    reply = apb.ModelState(replicas=[apb.ModelState(address=a, expert_distribution=ed.to_proto(d))
                                     for a, d in (("10.0.0.1:50051", one), ("10.0.0.2:50051", two))])
    body = distribution_body(reply)
    assert {k: v for k, v in body.items() if k != "replicas"} == {
        "layers": [0, 2], "logical_count": [[1, 7, 1], [4, 1, 1]], "forwards": 7, "seconds": 3.0, "recording": True}
    assert [r["address"] for r in body["replicas"]] == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert body["replicas"][1]["logical_count"] == two.logical_count
    saved = tmp_path / "fleet.json"
    saved.write_text(json.dumps(body))
    assert ExpertDump.load(str(saved)).logical_count == [[1, 7, 1], [4, 1, 1]]
    with pytest.raises(ValueError, match="differ"):
        ed.merged([ed.to_dict(ed.to_proto(one)), {**ed.to_dict(ed.to_proto(two)), "layers": [0, 1]}])


def test_every_model_admin_stage_serves_the_rpc():
    from services.common.admin_forward import ForwardingAdmin
    from services.router.admin_fanout import FanOutAdmin
    from services.scheduler.admin_service import SchedulerAdminService
    from services.worker.admin_service import WorkerAdminService
    rpcs = set(apb.DESCRIPTOR.services_by_name["ModelAdmin"].methods_by_name)
    assert set(METHODS) == rpcs  # the tokenizer forwards, the router fans out, the worker serves each
    for stage in (ForwardingAdmin, FanOutAdmin, SchedulerAdminService, WorkerAdminService):
        assert "ExpertDistribution" in vars(stage), stage


def test_the_engine_records(tmp_path):
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import Engine
    from services.worker.config import WorkerConfig
    from tests.unit.tiny_models import save_for_generation
    path, _ = save_for_generation(tmp_path, "qwen3_moe")
    engine = Engine(worker=WorkerConfig(model=path, dtype="float32", kv_cache_bytes=4 << 20, max_requests=4))
    try:
        assert engine.expert_distribution("start").recording
        prompts, new = [list(range(3, 13)), list(range(60, 67))], 5
        outs = engine.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
        assert all(len(o.token_ids) == new for o in outs)
        dump = engine.expert_distribution("stop")
        run = sum(len(p) + new - 1 for p in prompts)  # the last sampled token is never fed back
        assert not dump.recording and [sum(row) for row in dump.logical_count] == [run * K] * 2
        assert engine.expert_distribution("dump").logical_count == dump.logical_count
        with pytest.raises(ValueError, match="action"):
            engine.expert_distribution("pause")
    finally:
        engine.shutdown()


def test_a_flush_sent_to_a_worker_directly_is_refused_naming_the_scheduler(moe):
    from protos.radixmesh.v1 import scheduler_pb2
    with pytest.raises(AdminError) as err:
        WorkerAdmin(moe).handle("FlushCache", scheduler_pb2.FlushCacheRequest())
    assert err.value.status_code == AdminError(FAILED_PRECONDITION, "").status_code
    assert "scheduler" in err.value.message
