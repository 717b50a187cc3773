"""Reading deploy/k8s/ as rendered objects, and the fleet's invariants as checks
(tests/unit/test_k8s_manifests.py runs them on every tree). Each check raises AssertionError
naming the object, the container and what broke."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import kubernetes_validate

from services.common.config import config_from_args, flags_from_dataclass
from tests.unit.kustomize_lite import load_documents, pod_spec

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.29", kubernetes_validate.latest_version())  # the oldest release we claim, the newest bundled
FLAGS_DIR = "/etc/radixmesh"  # where a container's flags ConfigMap is mounted: <service>.flags
SERVE = "set -f; exec radixmesh serve \"$0\" $(grep -v '^[[:space:]]*#' \"/etc/radixmesh/$0.flags\")"
# A worker group's pods (overlays/worker-group): the same, plus the pod's node rank from its env.
NODE_RANK_ENV = "RADIXMESH_NODE_RANK"
GROUP_SERVE = SERVE + f' --node-rank "${NODE_RANK_ENV}"'
# Any other SERVE + "--flag VALUE ...": a per-pod value the flags file cannot hold, from the
# container's env (e.g. the pod's IP through the downward API: overlays/pd).
POD_IP = "10.244.0.{}"  # what the downward API's status.podIP gives pod `ordinal` here
POD_INDEX = "apps.kubernetes.io/pod-index"  # labels the StatefulSet controller adds to each pod
POD_NAME = "statefulset.kubernetes.io/pod-name"
CONFIGS = {  # `radixmesh serve <service>` -> its config dataclass (the flags it accepts)
    "tokenizer": "services.tokenizer.main:TokenizerServiceConfig",
    "detokenizer": "services.detokenizer.main:DetokenizerServiceConfig",
    "scheduler": "services.scheduler.main:SchedulerServiceConfig",
    "worker": "services.worker.main:WorkerServiceConfig",
    "gateway": "services.gateway.config:GatewayConfig",
    "kvstore": "services.kvstore.main:KVStoreConfig",
    "router": "services.router.config:RouterConfig",
}
QUEUE_METRIC = "radixmesh:num_requests_waiting"  # services/scheduler/telemetry.py, prefixed (common/metrics.py)


@dataclass
class Container:
    workload: dict  # the Deployment or StatefulSet
    spec: dict  # the container
    service: str  # radixmesh serve <service>
    argv: list[str]  # its flags (a worker group's: as pod 0 runs them)
    config: Any  # its config dataclass, parsed from argv
    pods: list[tuple[list[str], Any]] | None = None  # a worker group's: each pod's (argv, config), by ordinal

    @property
    def group(self) -> bool:
        return self.pods is not None

    @property
    def port(self) -> int:
        return int(self.config.common.listen.rpartition(":")[2])

    @property
    def where(self) -> str:
        return f"{self.workload['kind']} {self.workload['metadata']['name']}, container {self.spec['name']}"


@dataclass
class Rendered:
    objects: list[dict]
    containers: list[Container]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict]:
        return [o for o in self.objects if pod_spec(o) is not None]

    def serving(self, service: str) -> Container:
        found = [c for c in self.containers if c.service == service]
        assert len(found) == 1, f"expected one {service} container, got {[c.where for c in found]}"
        return found[0]


# --- reading the manifests ----------------------------------------------------------------
def pod_labels(workload: dict) -> list[dict]:
    """The labels of each pod a workload makes: a StatefulSet's pods by ordinal (the template's
    plus the controller's pod-name and pod-index), any other workload's as its template's."""
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    if workload["kind"] != "StatefulSet":
        return [dict(labels)]
    name = workload["metadata"]["name"]
    return [{**labels, POD_NAME: f"{name}-{i}", POD_INDEX: str(i)}
            for i in range(workload["spec"].get("replicas", 1))]


def downward(field_path: str, workload: dict, ordinal: int) -> str:
    """What the downward API gives pod `ordinal` of `workload` for `field_path` (the fields used here)."""
    m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field_path)
    if m:
        value = pod_labels(workload)[ordinal].get(m.group(1))
        assert value is not None, f"{workload['metadata']['name']}: no pod label {m.group(1)}"
        return value
    if field_path == "status.podIP":
        return POD_IP.format(10 + ordinal)
    assert field_path == "metadata.name", f"{workload['metadata']['name']}: downward API field {field_path}"
    return pod_labels(workload)[ordinal].get(POD_NAME, workload["metadata"]["name"])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # not SystemExit: the failing test says which flag
        raise AssertionError(f"{self.prog}: {message}")


def flag_argv(text: str) -> list[str]:
    """A flags file as the container's `sh` reads it: comment lines dropped, words split on blanks."""
    return [w for line in text.splitlines() if not line.lstrip().startswith("#") for w in line.split()]


def parse_flags(service: str, argv: list[str]) -> Any:
    """The service's config from `argv`, through its own flag builder and validation."""
    module, name = CONFIGS[service].split(":")
    cls = getattr(importlib.import_module(module), name)
    parser = _Parser(prog=f"radixmesh serve {service}", add_help=False)
    flags_from_dataclass(cls, parser)
    args = parser.parse_args(argv)
    try:
        return config_from_args(cls, args)
    except ValueError as e:
        raise AssertionError(f"radixmesh serve {service} {' '.join(argv)}: {e}") from None


def read_container(objects: list[dict], workload: dict, spec: dict) -> Container:
    where = f"{workload['metadata']['name']}/{spec['name']}"
    command = spec.get("command", [])
    assert command[:2] == ["sh", "-c"] and command[2].startswith(SERVE) and len(command) == 4, \
        f"{where}: command {command}"
    service = command[3]
    assert service in CONFIGS, f"{where}: unknown service {service}"
    mounts = {m["mountPath"]: m["name"] for m in spec.get("volumeMounts", [])}
    assert FLAGS_DIR in mounts, f"{where}: no flags mounted at {FLAGS_DIR}"
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mounts[FLAGS_DIR])
    configmap = next((o for o in objects if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"] == volume["configMap"]["name"]), None)
    assert configmap is not None, f"{where}: no ConfigMap {volume['configMap']['name']}"
    text = configmap["data"].get(f"{service}.flags")
    assert text is not None, f"{where}: ConfigMap {configmap['metadata']['name']} has no {service}.flags"
    argv = flag_argv(text)
    if command[2] != GROUP_SERVE:
        argv += command_flags(command[2][len(SERVE):], spec, workload, where)
        return Container(workload, spec, service, argv, parse_flags(service, argv))
    # A worker group: the flags plus each pod's --node-rank, as the downward API fills the env.
    env = {e["name"]: e for e in spec.get("env", [])}
    assert workload["kind"] == "StatefulSet", f"{where}: --node-rank from the pod needs a StatefulSet's ordinals"
    assert NODE_RANK_ENV in env, f"{where}: no env {NODE_RANK_ENV}"
    source = env[NODE_RANK_ENV]
    pods = []
    for ordinal in range(len(pod_labels(workload))):
        rank = source["value"] if "value" in source else downward(
            source["valueFrom"]["fieldRef"]["fieldPath"], workload, ordinal)
        pod_argv = [*argv, "--node-rank", rank]
        pods.append((pod_argv, parse_flags(service, pod_argv)))
    return Container(workload, spec, service, pods[0][0], pods[0][1], pods)


def command_flags(suffix: str, spec: dict, workload: dict, where: str) -> list[str]:
    """The flags a container's command adds after its flags file, as `sh` expands them in pod 0:
    each `$NAME` from the container's env (a value, or the downward API's)."""
    env = {e["name"]: e for e in spec.get("env", [])}

    def value(m: re.Match) -> str:
        assert m.group(1) in env, f"{where}: the command uses ${m.group(1)}, which its env lacks"
        source = env[m.group(1)]
        return source["value"] if "value" in source else downward(
            source["valueFrom"]["fieldRef"]["fieldPath"], workload, 0)

    words = shlex.split(suffix)
    assert all(w.startswith("--") or not w.startswith("-") for w in words), f"{where}: command adds {words}"
    return [re.sub(r"\$(\w+)", value, w) for w in words]


def engine_role(r: "Rendered", c: Container) -> str:
    """The disaggregation mode of the engine pod `c` is in ("" = co-located): its scheduler's."""
    modes = {s.config.disaggregation.disaggregation_mode for s in r.containers
             if s.service == "scheduler" and s.workload is c.workload}
    assert len(modes) <= 1, f"{c.where}: schedulers of several modes in one pod"
    mode = modes.pop() if modes else "null"
    return "" if mode == "null" else mode


def inspect(objects: list[dict]) -> Rendered:
    containers = [read_container(objects, w, c) for w in objects if pod_spec(w) is not None
                  for c in pod_spec(w)["containers"]]
    return Rendered(objects, containers)


# --- the checks: each raises AssertionError naming what broke ----------------------------
def check_schemas(r: Rendered) -> None:
    for obj in r.objects:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                raise AssertionError(f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): "
                                     f"{path}: {e.message}") from None


def prestop_sleep(c: Container) -> int:
    command = c.spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    assert len(command) == 2 and command[0] == "sleep" and command[1].isdigit(), f"{c.where}: preStop {command}"
    return int(command[1])


def group_leader(c: Container) -> str:
    """A worker group's leader as every pod reaches it: pod 0 by name in the governing Service."""
    return f"{c.workload['metadata']['name']}-0.{c.workload['spec']['serviceName']}"


def check_probes(r: Rendered) -> None:
    for c in r.containers:
        if c.group:  # every pod asks the leader (pod 1 serves nothing): ready while the group serves
            health = ["radixmesh", "healthcheck", f"{group_leader(c)}:{c.port}"]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.spec.get(kind)
                assert probe is not None and probe.get("exec", {}).get("command") == health, \
                    f"{c.where}: {kind} {probe} does not run {' '.join(health)}"
        for kind in () if c.group else ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.spec.get(kind)
            assert probe is not None or kind == "startupProbe", f"{c.where}: no {kind}"
            if probe is not None:
                assert probe.get("grpc", {}).get("port") == c.port, f"{c.where}: {kind} {probe} is not gRPC on {c.port}"
                assert probe["grpc"].get("service", "") == "", f"{c.where}: {kind} checks a named service"
        liveness = c.spec["livenessProbe"]
        window = liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3)
        drain = prestop_sleep(c) + c.config.common.drain_timeout_s
        assert window > drain, f"{c.where}: liveness gives up after {window}s, within a drain ({drain}s)"


def check_grace_covers_drain(r: Rendered) -> None:
    for w in r.workloads():
        grace = pod_spec(w).get("terminationGracePeriodSeconds", 30)
        for c in (c for c in r.containers if c.workload is w):
            drain = prestop_sleep(c) + c.config.common.drain_timeout_s
            assert grace > drain, f"{c.where}: terminationGracePeriodSeconds {grace} <= preStop + drain {drain}"


def check_configmaps(r: Rendered) -> None:
    used: set[tuple[str, str]] = set()
    for w in r.workloads():
        spec = pod_spec(w)
        names = [v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v]
        for c in spec["containers"]:
            names += [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
            names += [e["valueFrom"]["configMapKeyRef"]["name"] for e in c.get("env", [])
                      if "configMapKeyRef" in e.get("valueFrom", {})]
        for name in names:
            assert r.get("ConfigMap", name) is not None, f"{w['metadata']['name']} refers to no ConfigMap {name}"
    for c in r.containers:
        flags = next(v for v in pod_spec(c.workload)["volumes"] if v["name"] == mount_name(c, FLAGS_DIR))
        used.add((flags["configMap"]["name"], f"{c.service}.flags"))
    for cm in r.of_kind("ConfigMap"):
        for key in cm.get("data", {}):
            if key.endswith(".flags"):
                assert (cm["metadata"]["name"], key) in used, \
                    f"ConfigMap {cm['metadata']['name']}: {key} is read by no container"


def mount_name(c: Container, path: str) -> str:
    return next(m["name"] for m in c.spec["volumeMounts"] if m["mountPath"] == path)


def _pods_selected(r: Rendered, selector: dict, namespace: str | None) -> list[dict]:
    """The workloads with a pod that `selector` selects."""
    return [w for w in r.workloads() if _ordinals_selected(w, selector, namespace)]


def _ordinals_selected(w: dict, selector: dict, namespace: str | None) -> list[int]:
    """Which of w's pods (by ordinal: a StatefulSet's, else [0]) `selector` selects."""
    if w["metadata"].get("namespace") != namespace:
        return []
    return [i for i, labels in enumerate(pod_labels(w)) if selector.items() <= labels.items()]


def check_services_select_pods(r: Rendered) -> None:
    for svc in r.of_kind("Service"):
        pods = _pods_selected(r, svc["spec"]["selector"], svc["metadata"].get("namespace"))
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        ports = {p.get("name"): p["containerPort"] for w in pods for c in pod_spec(w)["containers"]
                 for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports or target in ports.values(), f"Service {svc['metadata']['name']}: no port {target}"
        if svc["spec"].get("clusterIP") == "None" and any(w["kind"] == "StatefulSet" for w in pods):
            assert any(w["spec"].get("serviceName") == svc["metadata"]["name"] for w in pods), \
                f"Service {svc['metadata']['name']} governs no StatefulSet it selects"


def _service_port(r: Rendered, address: str) -> tuple[dict, dict]:
    """The Service (and its port) that `NAME[.namespace...]:PORT` reaches."""
    host, _, port = address.rpartition(":")
    svc = r.get("Service", host.split(".")[0])
    assert svc is not None, f"{address}: no Service {host.split('.')[0]}"
    match = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    assert match, f"{address}: Service {svc['metadata']['name']} has no port {port}"
    return svc, match[0]


def check_addresses(r: Rendered) -> None:
    """Every peer address a service dials: a container of the same pod on loopback, else a Service
    whose port leads to a container listening there."""
    for c in r.containers:
        for name, address in _addresses(c.config):
            host, _, port = address.rpartition(":")
            if host == "127.0.0.1":
                peers = [p for p in r.containers if p.workload is c.workload and p.port == int(port)]
                assert peers, f"{c.where}: --{name} {address}: nothing in the pod listens on {port}"
                continue
            pod = _stateful_pod(r, host, c.workload["metadata"].get("namespace"))
            if pod is not None:  # POD.SERVICE: one pod of a StatefulSet, by name; any port it declares
                w, _ = pod
                assert any(_container_port(p, int(port)) for p in r.containers if p.workload is w), \
                    f"{c.where}: --{name} {address}: the pod declares no port {port}"
                continue
            svc, svc_port = _service_port(r, address)
            listening = [p for p in r.containers if p.workload in _pods_selected(r, svc["spec"]["selector"],
                                                                                 svc["metadata"].get("namespace"))
                         and _container_port(p, svc_port.get("targetPort", svc_port["port"])) == p.port]
            assert listening, f"{c.where}: --{name} {address} leads to no listening container"


def _stateful_pod(r: Rendered, host: str, namespace: str | None) -> tuple[dict, int] | None:
    """`<statefulset>-<i>.<headless service>[...]`: (the StatefulSet, i), if it names one's pod."""
    parts = host.split(".")
    if len(parts) < 2:
        return None
    for w in r.of_kind("StatefulSet"):
        name = w["metadata"]["name"]
        if w["spec"].get("serviceName") == parts[1] and w["metadata"].get("namespace") == namespace \
                and parts[0].startswith(name + "-") and parts[0][len(name) + 1:].isdigit():
            ordinal = int(parts[0][len(name) + 1:])
            assert ordinal < w["spec"].get("replicas", 1), f"{host}: {name} has no pod {ordinal}"
            return w, ordinal
    return None


def _addresses(config: Any) -> list[tuple[str, str]]:
    out = []
    for group in (config, *(getattr(config, g) for g in ("hicache",) if hasattr(config, g))):
        for field in vars(group):
            value = getattr(group, field)
            if field.endswith("_addr") and isinstance(value, str):
                out.append((field.replace("_", "-"), value))
    return out


def _container_port(c: Container, target: Any) -> int | None:
    for p in c.spec.get("ports", []):
        if target in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def check_router_discovers_engine_by_dns(r: Rendered) -> None:
    """Each pool the router routes to (one co-located pool, or a disaggregated fleet's prefill and
    decode pools) is a headless Service's DNS name that selects exactly that pool's engine pods."""
    router = r.serving("router")
    cfg = router.config
    pools = {"prefill": cfg.prefill_dns, "decode": cfg.decode_dns} if cfg.disaggregated else {"": cfg.replica_dns}
    for role, target in pools.items():
        assert target, f"{router.where}: no --{role or 'replica'}-dns"
    assert not (cfg.replica_addrs or cfg.prefill or cfg.decode), f"{router.where}: a static replica list"
    for role, target in pools.items():
        tokenizers = [c for c in r.containers if c.service == "tokenizer" and engine_role(r, c) == role]
        assert len(tokenizers) == 1, f"{role or 'co-located'} engine pods: {[c.where for c in tokenizers]}"
        tokenizer = tokenizers[0]
        svc, port = _service_port(r, target)
        assert svc["spec"].get("clusterIP") == "None", f"Service {svc['metadata']['name']} is not headless"
        assert svc["spec"].get("publishNotReadyAddresses") is True  # the router health-checks loading pods itself
        pods = _pods_selected(r, svc["spec"]["selector"], svc["metadata"].get("namespace"))
        assert pods == [tokenizer.workload], \
            f"{svc['metadata']['name']} selects {[w['metadata']['name'] for w in pods]}, " \
            f"not the {role or 'engine'} pods"
        assert _container_port(tokenizer, port.get("targetPort", port["port"])) == tokenizer.port


def adapter_metric_name(series: str) -> str:
    """What prometheus-adapter (deploy/k8s/monitoring/) serves `series` as."""
    values = load_documents(K8S / "monitoring" / "prometheus-adapter-values.yaml")[0]
    for rule in values["rules"]["custom"]:
        if rule["seriesQuery"].startswith(series + "{"):
            assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
            return re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    raise AssertionError(f"no adapter rule serves {series}")


def check_hpa(r: Rendered) -> None:
    """One HPA per engine workload (a disaggregated fleet has two), on its schedulers' queue depth."""
    hpas = r.of_kind("HorizontalPodAutoscaler")
    schedulers = [c for c in r.containers if c.service == "scheduler"]
    if any(c.group for c in r.containers if c.service == "worker"):  # a worker takes one scheduler's Step stream
        assert not hpas, "an HPA would scale the schedulers of one worker group"
        for scheduler in schedulers:
            assert scheduler.workload["spec"].get("replicas") == 1, f"{scheduler.where}: not one replica"
        return
    assert len(hpas) == len(schedulers), f"{len(hpas)} HPAs for {len(schedulers)} engine workloads"
    targets = {}
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        target = r.get(ref["kind"], ref["name"])
        assert target is not None and ref["apiVersion"] == target["apiVersion"], f"HPA targets {ref}"
        targets[id(target)] = hpa
    for scheduler in schedulers:
        target = scheduler.workload
        hpa = targets.get(id(target))
        assert hpa is not None, f"HPA targets {[h['spec']['scaleTargetRef'] for h in hpas]}, not {scheduler.where}"
        assert "replicas" not in target["spec"], "the HPA owns the engine's replica count: no spec.replicas"
        [metric] = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert metric["metric"]["name"] == adapter_metric_name(QUEUE_METRIC), f"HPA on {metric['metric']['name']}"
        annotations = target["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(scheduler.config.common.metrics_port)


def check_pdbs(r: Rendered) -> None:
    covered = set()
    for pdb in r.of_kind("PodDisruptionBudget"):
        pods = _pods_selected(r, pdb["spec"]["selector"]["matchLabels"], pdb["metadata"].get("namespace"))
        assert pods, f"PodDisruptionBudget {pdb['metadata']['name']} selects no pods"
        covered.update(id(w) for w in pods)
    for w in r.of_kind("Deployment"):
        assert id(w) in covered, f"Deployment {w['metadata']['name']} has no PodDisruptionBudget"


def cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def check_security_and_resources(r: Rendered) -> None:
    for w in r.workloads():
        assert pod_spec(w)["securityContext"].get("runAsNonRoot") is True, f"{w['metadata']['name']}: may run as root"
    for c in r.containers:
        sc, res = c.spec.get("securityContext", {}), c.spec.get("resources", {})
        assert sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False, c.where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c.where
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(part, {})), f"{c.where}: no {part}"
    for worker in (c for c in r.containers if c.service == "worker"):
        threads, ranks = worker.config.worker.num_threads, worker.config.worker.ranks_per_node
        assert threads is not None and threads * ranks <= cpus(worker.spec["resources"]["limits"]["cpu"]), \
            f"{worker.where}: --num-threads {threads} x {ranks} ranks beyond its CPU limit"


def check_ingress(r: Rendered) -> None:
    [ingress] = r.of_kind("Ingress")
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            svc = r.get("Service", backend["name"])
            assert svc is not None, f"Ingress to no Service {backend['name']}"
            assert any(p.get("name") == backend["port"].get("name") or p["port"] == backend["port"].get("number")
                       for p in svc["spec"]["ports"]), f"Ingress to a port Service {backend['name']} lacks"
            assert _pods_selected(r, svc["spec"]["selector"], svc["metadata"].get("namespace"))[0] \
                is r.serving("gateway").workload


def check_worker_group(r: Rendered) -> None:
    """A worker over several pods: pod ordinal = --node-rank, every pod's --dist-init-addr names
    pod 0 through the headless Service that governs the StatefulSet (and lists pods before they
    are ready), the pods start together and agree on every flag but their rank, the group can run
    (group_refusal), and the scheduler dials pod 0 alone."""
    from services.worker.group.leader import group_refusal
    for c in (c for c in r.containers if c.group):
        w, name = c.workload, c.workload["metadata"]["name"]
        configs = [config for _, config in c.pods]
        nnodes = configs[0].worker.nnodes
        assert nnodes > 1, f"{c.where}: --nnodes {nnodes}: not a group over several pods"
        assert len(configs) == nnodes, f"StatefulSet {name}: replicas {len(configs)} != --nnodes {nnodes}"
        assert w["spec"].get("podManagementPolicy") == "Parallel", \
            f"StatefulSet {name}: podManagementPolicy {w['spec'].get('podManagementPolicy')}: the leader is " \
            "ready only once the other pods joined, so they must start together (Parallel)"
        ranks = [config.worker.node_rank for config in configs]
        assert ranks == list(range(nnodes)), f"StatefulSet {name}: pods 0..{nnodes - 1} run --node-rank {ranks}"
        leader = configs[0]
        for ordinal, config in enumerate(configs):
            assert replace(config, worker=replace(config.worker, node_rank=0)) == leader, \
                f"StatefulSet {name}: pod {ordinal}'s flags differ from pod 0's beyond --node-rank"
        why = group_refusal(leader.worker, leader.hicache)
        assert why is None, f"{c.where}: {why}"
        host, _, port = leader.worker.dist_init_addr.rpartition(":")
        pod = _stateful_pod(r, host, w["metadata"].get("namespace"))
        assert pod == (w, 0), f"{c.where}: --dist-init-addr {leader.worker.dist_init_addr} does not name pod 0 " \
            f"of {name} ({group_leader(c)})"
        assert _container_port(c, int(port)) == int(port), f"{c.where}: no containerPort {port} (the rendezvous)"
        governing = r.get("Service", w["spec"]["serviceName"])
        assert governing is not None and governing["spec"].get("clusterIP") == "None", \
            f"StatefulSet {name}: its serviceName {w['spec']['serviceName']} is no headless Service"
        assert governing["spec"].get("publishNotReadyAddresses") is True, \
            f"Service {w['spec']['serviceName']}: pod 0 must resolve before it is ready (publishNotReadyAddresses)"
        assert _ordinals_selected(w, governing["spec"]["selector"], w["metadata"].get("namespace")) == \
            list(range(nnodes)), f"Service {w['spec']['serviceName']} does not select every pod of {name}"
        # The schedulers that dial this group reach its pod 0 and no other pod.
        dialers = 0
        for s in (s for s in r.containers if s.service == "scheduler"):
            svc, svc_port = _service_port(r, s.config.worker_addr)
            selected = {(id(x), i) for x in r.workloads()
                        for i in _ordinals_selected(x, svc["spec"]["selector"], svc["metadata"].get("namespace"))}
            if any(key == id(w) for key, _ in selected):
                dialers += 1
                assert selected == {(id(w), 0)}, f"{s.where}: --worker-addr {s.config.worker_addr}: Service " \
                    f"{svc['metadata']['name']} selects pods {sorted(i for _, i in selected)} of {name}, " \
                    "not only the leader"
                assert _container_port(c, svc_port.get("targetPort", svc_port["port"])) == c.port
        assert dialers == 1, f"{dialers} schedulers dial worker group {name}"


def check_disaggregation(r: Rendered) -> None:
    """A disaggregated fleet (overlays/pd): in each engine pod the worker runs the scheduler's mode;
    a prefill scheduler advertises its own pod IP and port as --bootstrap-address, a decode worker
    its pod IP as --disaggregation-host (so the prefill workers reach it); every worker of the
    fleet uses one transfer backend, one that crosses hosts (not shm); no worker uses a kvstore."""
    workers = [c for c in r.containers if c.service == "worker"]
    roles = {id(c.workload): engine_role(r, c) for c in workers}
    if not any(roles.values()):
        return
    assert set(roles.values()) == {"prefill", "decode"}, f"engine pools {sorted(set(roles.values()))}"
    backends = {c.config.worker.disaggregation_transfer_backend for c in workers}
    assert len(backends) == 1 and backends != {"shm"}, f"transfer backends {sorted(backends)}: one, across hosts"
    for worker in workers:
        role, pod_ip = roles[id(worker.workload)], downward("status.podIP", worker.workload, 0)
        assert worker.config.worker.disaggregation_mode == role, \
            f"{worker.where}: --disaggregation-mode {worker.config.worker.disaggregation_mode}, its scheduler {role}"
        assert not worker.config.hicache.kvstore_addr, f"{worker.where}: a kvstore in a disaggregated fleet"
        if role == "decode":
            assert worker.config.worker.disaggregation_host == pod_ip, \
                f"{worker.where}: --disaggregation-host {worker.config.worker.disaggregation_host}, not its pod IP"
    for s in (c for c in r.containers if c.service == "scheduler" and roles.get(id(c.workload)) == "prefill"):
        want = f"{downward('status.podIP', s.workload, 0)}:{s.port}"
        assert s.config.bootstrap_address == want, \
            f"{s.where}: --bootstrap-address {s.config.bootstrap_address!r}, not its pod's {want}"
        assert _container_port(s, s.port) == s.port, f"{s.where}: no containerPort {s.port} (PrefillBootstrap)"


CHECKS: list[Callable[[Rendered], None]] = [
    check_schemas, check_probes, check_grace_covers_drain, check_configmaps, check_services_select_pods,
    check_addresses, check_router_discovers_engine_by_dns, check_hpa, check_pdbs, check_security_and_resources,
    check_ingress, check_worker_group, check_disaggregation]


