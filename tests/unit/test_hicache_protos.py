"""`radixmesh up` with a kvstore and several replicas. (StepPlan.kv_copies and
StepResult.kv_transfers round-trip through the worker proto in tests/unit/test_protos.py,
with every other step field.)"""
from __future__ import annotations


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
