"""deploy/k8s/, rendered offline (tests/unit/kustomize_lite.py) and checked: every object against the
Kubernetes OpenAPI schemas (kubernetes-validate's bundled JSON schemas, strict, so an unknown or
misspelt field fails), then the fleet's invariants (tests/unit/k8s_checks.py): gRPC probes on each
service's own port, grace periods and liveness windows that cover the drains, flags that the
services accept, the router discovering the engine pods through a headless Service, the HPA on the
scheduler's queue depth as the metrics adapter names it, PDBs and Services that select real pods,
ConfigMaps that exist; in overlays/worker-group, a worker over two pods of a StatefulSet wired as one
group (ordinal = node rank, pod 0 the rendezvous and the only pod the scheduler dials); in overlays/pd,
a prefill pool and a decode pool the router pairs (each found through its own headless Service, the
modes matching in each pod, the addresses a pod advertises its own). The breakage tests damage a
manifest on purpose to show that the checks bite."""
from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from services.launcher.serve import SERVICES
from tests.unit.k8s_checks import (CHECKS, CONFIGS, K8S, QUEUE_METRIC, ROOT, Rendered, adapter_metric_name,
                                   check_addresses, check_grace_covers_drain, check_hpa, check_pdbs, check_probes,
                                   check_disaggregation, check_router_discovers_engine_by_dns, check_schemas,
                                   check_security_and_resources, check_worker_group, inspect, mount_name)
from tests.unit.kustomize_lite import load_documents, pod_spec, render, strategic_merge

TREES = ("base", "overlays/cpu-small", "overlays/model-pvc", "overlays/worker-group", "overlays/pd")
GROUP = "overlays/worker-group"
PD = "overlays/pd"
ENGINE = ("tokenizer", "scheduler", "worker", "detokenizer")


@functools.lru_cache(maxsize=None)
def _rendered(tree: str) -> list[dict]:
    return render(K8S / tree)


def rendered(tree: str) -> Rendered:
    return inspect(copy.deepcopy(_rendered(tree)))


# --- the tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
@pytest.mark.parametrize("tree", TREES)
def test_manifests(tree: str, check: Callable[[Rendered], None]) -> None:
    check(rendered(tree))


def test_every_service_has_a_config_and_runs_in_the_fleet():
    assert set(CONFIGS) == set(SERVICES)
    for tree in TREES:
        want = [s for s in SERVICES if not (tree in (GROUP, PD) and s == "kvstore")]  # these run without one
        if tree == PD:
            want += ENGINE  # an engine pod per pool
        assert sorted(c.service for c in rendered(tree).containers) == sorted(want), tree


def test_the_queue_metric_is_the_schedulers():
    source = (ROOT / "services" / "scheduler" / "telemetry.py").read_text()
    assert f'"{QUEUE_METRIC.removeprefix("radixmesh:")}"' in source
    assert adapter_metric_name(QUEUE_METRIC) == "radixmesh_num_requests_waiting"


def test_the_scrape_job_labels_series_with_namespace_and_pod():
    [job] = load_documents(K8S / "monitoring" / "prometheus-scrape.yaml")[0]["scrape_configs"]
    targets = {r.get("target_label"): r.get("source_labels") for r in job["relabel_configs"]}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"] and targets["pod"] == ["__meta_kubernetes_pod_name"]


def test_overlays_change_what_they_say():
    small, pvc = rendered("overlays/cpu-small"), rendered("overlays/model-pvc")
    assert small.serving("worker").config.worker.num_threads == 2
    assert small.get("Deployment", "radixmesh-router")["spec"]["replicas"] == 1
    assert {o["metadata"].get("namespace") for o in small.objects if o["kind"] != "Namespace"} == {"radixmesh"}
    for service in ("worker", "tokenizer", "detokenizer"):
        c = pvc.serving(service)
        model = c.config.worker.model if service == "worker" else c.config.model
        assert model.startswith("/models/") and mount_name(c, "/models") == "models"
    assert pvc.get("PersistentVolumeClaim", "radixmesh-models") is not None


def test_the_worker_group_overlay_is_one_engine_over_a_two_pod_group():
    r = rendered(GROUP)
    worker, scheduler = r.serving("worker"), r.serving("scheduler")
    group = r.get("StatefulSet", "radixmesh-worker-group")
    assert worker.workload is group and worker.group
    assert [(config.worker.node_rank, config.worker.nnodes, config.worker.tp_size, config.worker.pp_size)
            for _, config in worker.pods] == [(0, 2, 1, 2), (1, 2, 1, 2)]
    assert {config.worker.dist_init_addr for _, config in worker.pods} == \
        {"radixmesh-worker-group-0.radixmesh-worker-group:29500"}
    assert [argv[-2:] for argv, _ in worker.pods] == [["--node-rank", "0"], ["--node-rank", "1"]]
    assert scheduler.config.worker_addr == "radixmesh-worker:50053"
    assert r.get("Service", "radixmesh-worker")["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == \
        "radixmesh-worker-group-0"
    engine = r.get("Deployment", "radixmesh-engine")
    assert "worker" not in [c["name"] for c in pod_spec(engine)["containers"]]
    assert "worker.flags" not in r.get("ConfigMap", "radixmesh-engine-flags")["data"]
    assert not r.of_kind("HorizontalPodAutoscaler") and r.get("StatefulSet", "radixmesh-kvstore") is None


def test_the_pd_overlay_pairs_a_prefill_pool_with_a_decode_pool():
    r = rendered(PD)
    router = r.serving("router").config
    assert router.disaggregated and (router.prefill_dns, router.decode_dns) == \
        ("radixmesh-engine:50051", "radixmesh-decode:50051")
    assert (router.prefill_policy, router.decode_policy) == ("cache_aware", "least_load")
    pods = {c.workload["metadata"]["name"]: c for c in r.containers if c.service == "scheduler"}
    assert {name: c.config.disaggregation.disaggregation_mode for name, c in pods.items()} == \
        {"radixmesh-engine": "prefill", "radixmesh-decode": "decode"}
    assert pods["radixmesh-engine"].config.bootstrap_address == "10.244.0.10:50052"  # its pod IP, its port
    assert pods["radixmesh-decode"].config.bootstrap_address == ""
    workers = {c.workload["metadata"]["name"]: c.config.worker for c in r.containers if c.service == "worker"}
    assert workers["radixmesh-decode"].disaggregation_host == "10.244.0.10"
    assert {w.disaggregation_transfer_backend for w in workers.values()} == {"grpc"}
    hpas = {h["spec"]["scaleTargetRef"]["name"] for h in r.of_kind("HorizontalPodAutoscaler")}
    assert hpas == {"radixmesh-engine", "radixmesh-decode"}
    assert r.get("StatefulSet", "radixmesh-kvstore") is None


def _named(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _engine_pod(objects: list[dict]) -> dict:
    return pod_spec(_named(objects, "Deployment", "radixmesh-engine"))


def _set_flags(objects: list[dict], configmap: str, key: str, text: str) -> None:
    _named(objects, "ConfigMap", configmap)["data"][key] = text


def misspell_a_field(objects: list[dict]) -> None:
    _engine_pod(objects)["terminationGracePeriod"] = 60


def probe_another_port(objects: list[dict]) -> None:
    worker = next(c for c in _engine_pod(objects)["containers"] if c["name"] == "worker")
    worker["readinessProbe"]["grpc"]["port"] = 50051


def cut_the_grace_period(objects: list[dict]) -> None:
    _engine_pod(objects)["terminationGracePeriodSeconds"] = 30


def give_the_router_a_static_list(objects: list[dict]) -> None:
    _set_flags(objects, "radixmesh-router-flags", "router.flags", "--listen 0.0.0.0:50055 --replica-addrs e:50051")


def scale_on_another_metric(objects: list[dict]) -> None:
    hpa = _named(objects, "HorizontalPodAutoscaler", "radixmesh-engine")
    hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] = "radixmesh_waiting"


def select_no_pods(objects: list[dict]) -> None:
    pdb = _named(objects, "PodDisruptionBudget", "radixmesh-engine")
    pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "engines"


def drop_a_configmap(objects: list[dict]) -> None:
    objects.remove(_named(objects, "ConfigMap", "radixmesh-kvstore-flags"))


def pass_an_unknown_flag(objects: list[dict]) -> None:
    _set_flags(objects, "radixmesh-engine-flags", "detokenizer.flags", "--listen 0.0.0.0:50054 --kv-cache-bytes 1")


def _read(r: Rendered) -> None:
    """Reading the manifests (inspect) is the check: flags parsed, ConfigMaps found."""


# (the breakage, the check that must catch it, what that check must say: the breakage, not something else)
BREAKAGES: list[tuple[Callable[[list[dict]], None], Callable[[Rendered], None], str]] = [
    (misspell_a_field, check_schemas, "'terminationGracePeriod' was unexpected"),
    (probe_another_port, check_probes, "container worker: readinessProbe .* is not gRPC on 50053"),
    (cut_the_grace_period, check_grace_covers_drain, "terminationGracePeriodSeconds 30 <= preStop \\+ drain"),
    (give_the_router_a_static_list, check_router_discovers_engine_by_dns, "container router: no --replica-dns"),
    (scale_on_another_metric, check_hpa, "HPA on radixmesh_waiting"),
    (select_no_pods, check_pdbs, "PodDisruptionBudget radixmesh-engine selects no pods"),
    (drop_a_configmap, _read, "no ConfigMap radixmesh-kvstore-flags"),
    (pass_an_unknown_flag, _read, "unrecognized arguments: --kv-cache-bytes 1")]


def _group(objects: list[dict]) -> dict:
    return _named(objects, "StatefulSet", "radixmesh-worker-group")


def _group_worker(objects: list[dict]) -> dict:
    return pod_spec(_group(objects))["containers"][0]


def _group_flags(objects: list[dict], old: str, new: str) -> None:
    data = _named(objects, "ConfigMap", "radixmesh-worker-group-flags")["data"]
    assert old in data["worker.flags"]
    data["worker.flags"] = data["worker.flags"].replace(old, new)


def rank_every_pod_0(objects: list[dict]) -> None:
    rank = next(e for e in _group_worker(objects)["env"] if e["name"] == "RADIXMESH_NODE_RANK")
    rank.pop("valueFrom")
    rank["value"] = "0"


def meet_at_pod_1(objects: list[dict]) -> None:
    _group_flags(objects, "radixmesh-worker-group-0.", "radixmesh-worker-group-1.")


def meet_at_a_service_address(objects: list[dict]) -> None:
    _group_flags(objects, "radixmesh-worker-group-0.radixmesh-worker-group:29500", "radixmesh-worker:29500")


def dial_every_pod_of_the_group(objects: list[dict]) -> None:
    del _named(objects, "Service", "radixmesh-worker")["spec"]["selector"]["statefulset.kubernetes.io/pod-name"]


def run_one_pod_for_two_nodes(objects: list[dict]) -> None:
    _group(objects)["spec"]["replicas"] = 1


def start_the_pods_in_order(objects: list[dict]) -> None:
    del _group(objects)["spec"]["podManagementPolicy"]


def hide_unready_pods(objects: list[dict]) -> None:
    del _named(objects, "Service", "radixmesh-worker-group")["spec"]["publishNotReadyAddresses"]


def probe_only_its_own_port(objects: list[dict]) -> None:
    _group_worker(objects)["readinessProbe"] = {"grpc": {"port": 50053}, "periodSeconds": 5}


def give_the_group_a_kvstore(objects: list[dict]) -> None:
    _group_flags(objects, "--dist-timeout-s 60", "--dist-timeout-s 60 --kvstore-addr radixmesh-engine:50051")


def ask_for_too_many_threads(objects: list[dict]) -> None:
    _group_flags(objects, "--tp-size 1 --pp-size 2", "--tp-size 3 --pp-size 2")


GROUP_BREAKAGES: list[tuple[Callable[[list[dict]], None], Callable[[Rendered], None], str]] = [
    (rank_every_pod_0, check_worker_group, r"pods 0..1 run --node-rank \[0, 0\]"),
    (meet_at_pod_1, check_worker_group, "does not name pod 0 of radixmesh-worker-group"),
    (meet_at_a_service_address, check_worker_group, "does not name pod 0"),
    (dial_every_pod_of_the_group, check_worker_group, r"selects pods \[0, 1\] of radixmesh-worker-group, not only"),
    (run_one_pod_for_two_nodes, check_worker_group, "replicas 1 != --nnodes 2"),
    (start_the_pods_in_order, check_worker_group, "must start together"),
    (hide_unready_pods, check_worker_group, "publishNotReadyAddresses"),
    (probe_only_its_own_port, check_probes, "readinessProbe .* does not run radixmesh healthcheck "
                                            "radixmesh-worker-group-0.radixmesh-worker-group:50053"),
    (give_the_group_a_kvstore, check_worker_group, "with a host KV tier or a kvstore is not supported"),
    (ask_for_too_many_threads, check_security_and_resources, "--num-threads 2 x 3 ranks beyond its CPU limit")]


def _pd_flags(objects: list[dict], configmap: str, key: str, old: str, new: str) -> None:
    data = _named(objects, "ConfigMap", configmap)["data"]
    assert old in data[key]
    data[key] = data[key].replace(old, new)


def decode_on_a_prefill_worker(objects: list[dict]) -> None:
    _pd_flags(objects, "radixmesh-decode-flags", "worker.flags", "--disaggregation-mode decode",
              "--disaggregation-mode prefill")


def advertise_loopback(objects: list[dict]) -> None:
    scheduler = next(c for c in _engine_pod(objects)["containers"] if c["name"] == "scheduler")
    scheduler["command"][2] = scheduler["command"][2].replace('"$RADIXMESH_POD_IP:50052"', "127.0.0.1:50052")


def transfer_through_shared_memory(objects: list[dict]) -> None:
    for configmap in ("radixmesh-engine-flags", "radixmesh-decode-flags"):
        _pd_flags(objects, configmap, "worker.flags", "--disaggregation-transfer-backend grpc",
                  "--disaggregation-transfer-backend shm")


def discover_both_pools_in_one_service(objects: list[dict]) -> None:
    _pd_flags(objects, "radixmesh-router-flags", "router.flags", "--decode-dns radixmesh-decode:50051",
              "--decode-dns radixmesh-engine:50051")


def use_an_undefined_variable(objects: list[dict]) -> None:
    decode = pod_spec(_named(objects, "Deployment", "radixmesh-decode"))
    worker = next(c for c in decode["containers"] if c["name"] == "worker")
    worker["env"] = [e for e in worker["env"] if e["name"] != "RADIXMESH_POD_IP"]


def _read_pd(r: Rendered) -> None:
    """Reading the manifests (inspect) is the check: the command's variables come from the env."""


PD_BREAKAGES: list[tuple[Callable[[list[dict]], None], Callable[[Rendered], None], str]] = [
    (decode_on_a_prefill_worker, check_disaggregation, "--disaggregation-mode prefill, its scheduler decode"),
    (advertise_loopback, check_disaggregation, "--bootstrap-address '127.0.0.1:50052', not its pod's 10.244.0.10"),
    (transfer_through_shared_memory, check_disaggregation, r"transfer backends \['shm'\]"),
    (discover_both_pools_in_one_service, check_router_discovers_engine_by_dns,
     "radixmesh-engine selects \\['radixmesh-engine'\\], not the decode pods"),
    (use_an_undefined_variable, _read_pd, r"uses \$RADIXMESH_POD_IP, which its env lacks")]


@pytest.mark.parametrize(("breaking", "check", "message"), PD_BREAKAGES, ids=[b.__name__ for b, _, _ in PD_BREAKAGES])
def test_a_broken_pd_overlay_fails(breaking: Callable[[list[dict]], None], check: Callable[[Rendered], None],
                                   message: str) -> None:
    objects = copy.deepcopy(_rendered(PD))
    check(inspect(copy.deepcopy(objects)))  # fine before
    breaking(objects)
    with pytest.raises(AssertionError, match=message):
        check(inspect(objects))


@pytest.mark.parametrize(("breaking", "check", "message"), GROUP_BREAKAGES,
                         ids=[b.__name__ for b, _, _ in GROUP_BREAKAGES])
def test_a_broken_worker_group_fails(breaking: Callable[[list[dict]], None], check: Callable[[Rendered], None],
                                     message: str) -> None:
    objects = copy.deepcopy(_rendered(GROUP))
    check(inspect(copy.deepcopy(objects)))  # fine before
    breaking(objects)
    with pytest.raises(AssertionError, match=message):
        check(inspect(objects))


@pytest.mark.parametrize(("breaking", "check", "message"), BREAKAGES, ids=[b.__name__ for b, _, _ in BREAKAGES])
def test_a_broken_manifest_fails(breaking: Callable[[list[dict]], None], check: Callable[[Rendered], None],
                                 message: str) -> None:
    objects = copy.deepcopy(_rendered("base"))
    check(inspect(copy.deepcopy(objects)))  # fine before
    breaking(objects)
    with pytest.raises(AssertionError, match=message):
        check(inspect(objects))


def test_renderer_merges_named_lists_and_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    base = {"spec": {"containers": [{"name": "a", "image": "x", "volumeMounts": [{"mountPath": "/m", "name": "v"}]}],
                     "args": ["1", "2"]}}
    patch = {"spec": {"containers": [{"name": "a", "volumeMounts": [{"mountPath": "/n", "name": "w"}]},
                                     {"name": "b", "image": "y"}], "args": ["3"]}}
    merged = strategic_merge(base, patch)
    assert [c["name"] for c in merged["spec"]["containers"]] == ["a", "b"]
    assert merged["spec"]["containers"][0]["image"] == "x"
    assert [m["mountPath"] for m in merged["spec"]["containers"][0]["volumeMounts"]] == ["/m", "/n"]
    assert merged["spec"]["args"] == ["3"]
    dropped = strategic_merge(merged, {"spec": {"containers": [{"name": "a", "$patch": "delete"}]}})
    assert [c["name"] for c in dropped["spec"]["containers"]] == ["b"]
    with pytest.raises(ValueError, match="containers c, which the base lacks"):
        strategic_merge(merged, {"spec": {"containers": [{"name": "c", "$patch": "delete"}]}})
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(ValueError, match="configMapGenerator"):
        render(tmp_path)


def _normalized(obj: Any) -> Any:
    """Order-free form: kustomize may put patched list items first."""
    if isinstance(obj, dict):
        return {k: _normalized(v) for k, v in obj.items()}
    if isinstance(obj, list):
        items = [_normalized(v) for v in obj]
        return sorted(items, key=lambda v: yaml.safe_dump(v, sort_keys=True))
    return obj


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (the check is optional)")
@pytest.mark.parametrize("tree", TREES)
def test_the_renderer_agrees_with_kubectl_kustomize(tree: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / tree)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = {(o["kind"], o["metadata"]["name"]): _normalized(o) for o in yaml.safe_load_all(out.stdout) if o}
    ours = {(o["kind"], o["metadata"]["name"]): _normalized(o) for o in _rendered(tree)}
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == theirs[key], key
