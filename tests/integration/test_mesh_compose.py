"""compose.yaml stays consistent with the launcher (no Docker here; scripts/compose_check.sh runs
it in a real engine): every service of the launcher's topology runs `serve <name>` with flags
its config accepts, peers point at the peer's listen port, start waits on the peer's health
check, which probes it, and stop_grace_period outlasts the drain; every service sends traces
to the compose collector and is scraped by the compose Prometheus."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from services.common.config import config_from_args, flags_from_dataclass
from services.launcher.up import CONFIG_CLASSES, STOP_ORDER, TOPOLOGY, load_ref
from tests.integration.mesh_harness import REPO

import yaml  # noqa: E402 (pyyaml: a test extra)


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)", text)
    assert m, text
    return float(m.group(1)) * (60 if m.group(2) == "m" else 1)


OBSERVABILITY = {"collector", "prometheus"}


def load_compose(path: Path) -> dict:
    """A compose file as compose reads it with no variables set: `${VAR:-default}` -> default."""
    text = re.sub(r"\$\{\w+:-([^}]*)\}", lambda m: m.group(1), path.read_text())
    assert "${" not in text, "a variable without a default"
    return yaml.safe_load(text)


def _radixmesh_services() -> dict:
    services = load_compose(REPO / "compose.yaml")["services"]
    assert OBSERVABILITY <= set(services)
    return {name: svc for name, svc in services.items() if name not in OBSERVABILITY}


def test_compose_matches_the_launcher_topology():
    compose = _radixmesh_services()
    assert set(compose) == {name for name, _ in TOPOLOGY}
    listen_port = {}
    configs = {}
    for name, _ in TOPOLOGY:
        svc = compose[name]
        assert svc["command"][:2] == ["serve", name]
        cls = load_ref(CONFIG_CLASSES[name])
        assert cls is not None, name
        parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
        flags_from_dataclass(cls, parser)
        configs[name] = config = config_from_args(cls, parser.parse_args(svc["command"][2:]))
        host, _, port = config.common.listen.rpartition(":")
        assert host == "0.0.0.0", name
        listen_port[name] = port
        assert svc["healthcheck"]["test"] == ["CMD", "radixmesh", "healthcheck", f"127.0.0.1:{port}"]
        assert _seconds(svc["stop_grace_period"]) > config.common.drain_timeout_s, name
    for name, peers in TOPOLOGY:
        for flag, peer in peers:
            attr = flag.removeprefix("--").replace("-", "_")
            assert getattr(configs[name], attr) == f"{peer}:{listen_port[peer]}", (name, flag)
            # compose starts a service once its peers are healthy and stops dependents first:
            # the launcher's start order and its front-to-back stop order
            assert compose[name]["depends_on"][peer] == {"condition": "service_healthy"}, (name, peer)
    order = [name for group in STOP_ORDER for name in group]
    assert sorted(order) == sorted(compose)


def test_docs_show_the_example_client_verbatim():
    example = (REPO / "examples" / "grpc_client.py").read_text()
    assert f"```python\n{example}```" in (REPO / "docs" / "mesh.md").read_text()


def test_every_service_is_traced_and_scraped():
    compose = _radixmesh_services()
    everything = load_compose(REPO / "compose.yaml")["services"]
    collector = everything["collector"]
    assert "127.0.0.1:4317:4317" in collector["ports"]
    # the image carries the collector where the compose entrypoint runs it
    script = collector["entrypoint"][-1]
    assert f"COPY deploy/collector/otlp_collector.py {script}" in (REPO / "Dockerfile").read_text()
    mount = everything["prometheus"]["volumes"][0]
    assert mount.startswith("./deploy/prometheus.yml:/etc/prometheus/prometheus.yml")
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for group in job["static_configs"]
               for t in group["targets"]}
    expected = set()
    for name, _ in TOPOLOGY:
        svc = compose[name]
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317", name
        assert svc["depends_on"]["collector"] == {"condition": "service_healthy"}, name
        parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
        flags_from_dataclass(load_ref(CONFIG_CLASSES[name]), parser)
        config = config_from_args(load_ref(CONFIG_CLASSES[name]), parser.parse_args(svc["command"][2:]))
        # the gateway serves /metrics on its HTTP port; the others on --metrics-port
        port = config.http_port if name == "gateway" else config.common.metrics_port
        assert port is not None, f"{name} has no --metrics-port"
        expected.add(f"{name}:{port}")
    assert targets == expected


def test_compose_runs_contained():
    """What a stack left running on a laptop needs: ports on loopback unless RADIXMESH_BIND says
    otherwise, memory limits, restarts, and the worker's one capability kept by setpriv."""
    everything = load_compose(REPO / "compose.yaml")["services"]
    for name, svc in everything.items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["mem_limit"], name
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    worker = everything["worker"]
    assert worker["cap_add"] == ["SYS_NICE"] and worker["user"] == "root"
    entry = worker["entrypoint"]
    assert entry[0] == "setpriv" and "--reuid=10001" in entry and entry[-2:] == ["--", "radixmesh"]
    assert "--bounding-set=-all,+sys_nice" in entry
    assert "useradd --create-home --uid 10001 radixmesh" in (REPO / "Dockerfile").read_text()
