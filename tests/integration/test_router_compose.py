"""compose.yaml + compose.fleet.yaml run the launcher's two-replica plan (no Docker here;
scripts/compose_check.sh runs it in a real engine): each planned child is a service running
`serve <its service>` with flags its config accepts, peers point at their peers' listen ports
(the router at both tokenizers), health checks probe it; Prometheus scrapes every one."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from services.common.config import config_from_args, flags_from_dataclass
from services.launcher.up import CONFIG_CLASSES, FLEET_STOP_ORDER, load_ref, plan, worker_threads
from tests.integration.mesh_harness import REPO
from tests.integration.test_mesh_compose import load_compose

import yaml  # noqa: E402 (pyyaml: a test extra)


def _merged() -> dict:
    base = load_compose(REPO / "compose.yaml")["services"]
    fleet = load_compose(REPO / "compose.fleet.yaml")["services"]
    out = dict(base)
    for name, svc in fleet.items():
        out[name] = {**base.get(name, {}), **svc}
    return out


def _field(config, name: str):
    """A flag's value in a service config, looking inside its nested config groups too."""
    if hasattr(config, name):
        return getattr(config, name)
    for group in vars(config).values():
        if dataclasses.is_dataclass(group) and hasattr(group, name):
            return getattr(group, name)
    raise AttributeError(name)


def test_fleet_overlay_matches_the_launcher_plan():
    compose = _merged()
    planned = plan(2, False, True, kvstore=True)  # --replicas 2 starts a kvstore by default
    names = {p.name: p.name.replace("-0", "") for p in planned}  # compose's replica 0 has the plain names
    configs, ports = {}, {}
    for p in planned:
        svc = compose[names[p.name]]
        assert svc["command"][:2] == ["serve", p.service], p.name
        cls = load_ref(CONFIG_CLASSES[p.service])
        parser = argparse.ArgumentParser(prog=p.name, exit_on_error=False)
        flags_from_dataclass(cls, parser)
        configs[p.name] = config = config_from_args(cls, parser.parse_args(svc["command"][2:]))
        host, _, ports[p.name] = config.common.listen.rpartition(":")
        assert host == "0.0.0.0"
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{ports[p.name]}"
    for p in planned:
        for flag, peers in p.peers:
            value = _field(configs[p.name], flag.removeprefix("--").replace("-", "_"))
            want = [f"{names[peer]}:{ports[peer]}" for peer in peers]
            assert (value if isinstance(value, list) else [value]) == want, (p.name, flag)
            assert {names[peer] for peer in peers} <= set(compose[names[p.name]]["depends_on"]), p.name
    assert {p.service for p in planned} == {s for group in FLEET_STOP_ORDER for s in group}


def _config(svc: dict):
    cls = load_ref(CONFIG_CLASSES[svc["command"][1]])
    parser = argparse.ArgumentParser(exit_on_error=False)
    flags_from_dataclass(cls, parser)
    return config_from_args(cls, parser.parse_args(svc["command"][2:]))


def test_every_fleet_service_is_scraped():
    compose = _merged()
    fleet = load_compose(REPO / "compose.fleet.yaml")
    mount = fleet["services"]["prometheus"]["volumes"][0]
    assert mount.startswith("./deploy/prometheus.fleet.yml:/etc/prometheus/prometheus.yml")
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.fleet.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for group in job["static_configs"]
               for t in group["targets"]}
    expected = set()
    for name, svc in compose.items():
        if svc.get("command", [None])[0] != "serve":
            continue  # the collector and Prometheus
        config = _config(svc)
        port = config.http_port if name == "gateway" else config.common.metrics_port
        assert port is not None, f"{name} has no --metrics-port"
        expected.add(f"{name}:{port}")
    assert targets == expected


def test_fleet_shares_the_machine_like_the_launcher():
    """Two workers split the cores (by default as `up --replicas 2` does on 2 cores), the
    kvstore's disk tier is a named volume, the gateway stays on loopback."""
    compose = _merged()
    fleet = load_compose(REPO / "compose.fleet.yaml")
    for name in ("worker", "worker-1"):
        assert _field(_config(compose[name]), "num_threads") == worker_threads(2, cores=2), name
    kvstore = compose["kvstore"]
    volume, _, path = kvstore["volumes"][0].partition(":")
    assert volume in fleet["volumes"] and _field(_config(kvstore), "kvstore_disk_dir") == path
    assert compose["gateway"]["ports"] == ["127.0.0.1:8000:8000"]  # compose.yaml's, not overridden
