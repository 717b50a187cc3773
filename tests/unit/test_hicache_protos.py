"""StepPlan.kv_copies and StepResult.kv_transfers survive the worker proto."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.step_plan import TIERS, KVCopy, KVTransferStat, StepPlan, StepResult
from services.worker.convert import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto

PAGES = st.lists(st.integers(0, 2**32 - 1), max_size=5)
copies = st.builds(KVCopy, src_tier=st.sampled_from(TIERS), dst_tier=st.sampled_from(TIERS), src_pages=PAGES,
                   dst_pages=PAGES, keys=st.lists(st.binary(min_size=32, max_size=32), max_size=5))
stats = st.builds(KVTransferStat, pages=st.integers(0, 2**32 - 1), bytes=st.integers(0, 2**64 - 1),
                  seconds=st.floats(0, 1e6))


@settings(max_examples=100, deadline=None)
@given(st.lists(copies, max_size=4), st.lists(stats, max_size=4))
def test_kv_copies_and_transfer_stats_round_trip(kv_copies, kv_transfers) -> None:
    plan = StepPlan(step_id=3, kv_copies=kv_copies)
    assert plan_from_proto(type(plan_to_proto(plan)).FromString(plan_to_proto(plan).SerializeToString())) == plan
    result = StepResult(step_id=3, kv_transfers=kv_transfers)
    msg = result_to_proto(result)
    assert result_from_proto(type(msg).FromString(msg.SerializeToString())) == result


def test_up_with_a_kvstore_starts_it_first_and_wires_every_worker() -> None:
    from services.launcher.up import UpConfig, plan
    assert UpConfig(replicas=2).use_kvstore and not UpConfig().use_kvstore
    assert not UpConfig(replicas=2, kvstore=False).use_kvstore and UpConfig(kvstore=True).use_kvstore
    children = plan(2, False, True, kvstore=True)
    assert children[0].name == "kvstore"
    workers = [c for c in children if c.service == "worker"]
    assert len(workers) == 2 and all(("--kvstore-addr", ["kvstore"]) in w.peers for w in workers)
    assert all(c.service != "kvstore" for c in plan(2, False, True, kvstore=False))


def test_replicas_split_the_cores_between_their_workers():
    from services.launcher.up import worker_threads
    assert [worker_threads(n, cores=2) for n in (1, 2, 3)] == [2, 1, 1]
    assert worker_threads(4, cores=16) == 4
