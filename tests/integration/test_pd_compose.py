"""compose.yaml + compose.pd.yaml run the launcher's disaggregated plan (`radixmesh up --prefill 1
--decode 1`; no Docker here, scripts/compose_check.sh runs compose files in a real engine): each
planned child is a service running `serve <its service>` with flags its config accepts, its peers
at their listen ports, its role on worker and scheduler; the addresses a replica advertises are
its own container's; Prometheus scrapes every service."""
from __future__ import annotations

import argparse

from services.common.config import config_from_args, flags_from_dataclass
from services.launcher.up import CONFIG_CLASSES, FLEET_STOP_ORDER, load_ref, plan
from tests.integration.mesh_harness import REPO
from tests.integration.test_mesh_compose import load_compose
from tests.integration.test_router_compose import _field

import yaml  # noqa: E402 (pyyaml: a test extra)


def _merged() -> dict:
    base = load_compose(REPO / "compose.yaml")["services"]
    pd = load_compose(REPO / "compose.pd.yaml")["services"]
    return {**base, **{name: {**base.get(name, {}), **svc} for name, svc in pd.items()}}


def _compose_name(child: str) -> str:
    """The launcher's child -> its compose service: the prefill replica is compose.yaml's."""
    return child.replace("-prefill-0", "").replace("-decode-0", "-decode")


def _config(service: str, argv: list[str]):
    cls = load_ref(CONFIG_CLASSES[service])
    parser = argparse.ArgumentParser(prog=service, exit_on_error=False)
    flags_from_dataclass(cls, parser)
    return config_from_args(cls, parser.parse_args(argv))


def test_the_pd_overlay_matches_the_launcher_plan():
    compose = _merged()
    planned = plan(1, False, True, prefill=1, decode=1)
    configs, ports = {}, {}
    for p in planned:
        svc = compose[_compose_name(p.name)]
        assert svc["command"][:2] == ["serve", p.service], p.name
        configs[p.name] = config = _config(p.service, svc["command"][2:])
        host, _, ports[p.name] = config.common.listen.rpartition(":")
        assert host == "0.0.0.0"
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{ports[p.name]}"
        if p.service in ("worker", "scheduler"):
            assert _field(config, "disaggregation_mode") == p.role, p.name
    for p in planned:
        for flag, peers in p.peers:
            value = _field(configs[p.name], flag.removeprefix("--").replace("-", "_"))
            want = [f"{_compose_name(peer)}:{ports[peer]}" for peer in peers]
            assert (value if isinstance(value, list) else [value]) == want, (p.name, flag)
            assert {_compose_name(peer) for peer in peers} <= set(compose[_compose_name(p.name)]["depends_on"])
    assert {p.service for p in planned} <= {s for group in FLEET_STOP_ORDER for s in group}
    assert set(compose) - {_compose_name(p.name) for p in planned} == {"collector", "prometheus"}  # no kvstore


def test_what_a_replica_advertises_is_its_own_container():
    compose = _merged()
    scheduler = _config("scheduler", compose["scheduler"]["command"][2:])
    assert scheduler.bootstrap_address == f"scheduler:{scheduler.common.listen.rpartition(':')[2]}"
    decode_worker = _config("worker", compose["worker-decode"]["command"][2:])
    assert decode_worker.worker.disaggregation_host == "worker-decode"
    backends = {_config("worker", compose[name]["command"][2:]).worker.disaggregation_transfer_backend
                for name in ("worker", "worker-decode")}
    assert backends == {"grpc"}  # one backend, across containers
    for name in ("worker", "worker-decode"):
        assert not _config("worker", compose[name]["command"][2:]).hicache.kvstore_addr, name


def test_every_pd_service_is_scraped():
    compose = _merged()
    mount = load_compose(REPO / "compose.pd.yaml")["services"]["prometheus"]["volumes"][0]
    assert mount.startswith("./deploy/prometheus.pd.yml:/etc/prometheus/prometheus.yml")
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.pd.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = set()
    for name, svc in compose.items():
        if svc.get("command", [None])[0] != "serve":
            continue  # the collector and Prometheus
        config = _config(svc["command"][1], svc["command"][2:])
        port = config.http_port if name == "gateway" else config.common.metrics_port
        expected.add(f"{name}:{port}")
    assert targets == expected
