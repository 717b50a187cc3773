"""compose.yaml stays consistent with the launcher (no Docker here): every service of the
launcher's topology runs `serve <name>` with flags its config accepts, peers point at the
peer's listen port, health checks probe it, and stop_grace_period outlasts the drain; every
service sends traces to the compose Jaeger and is scraped by the compose Prometheus."""
from __future__ import annotations

import argparse
import re

import pytest

from services.common.config import config_from_args, flags_from_dataclass
from services.launcher.up import CONFIG_CLASSES, STOP_ORDER, TOPOLOGY, load_ref
from tests.integration.mesh_harness import REPO

yaml = pytest.importorskip("yaml")


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)", text)
    assert m, text
    return float(m.group(1)) * (60 if m.group(2) == "m" else 1)


OBSERVABILITY = {"jaeger", "prometheus"}


def _radixmesh_services() -> dict:
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
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
            # compose stops dependents first: the launcher's front-to-back order
            assert peer in compose[name].get("depends_on", []), (name, peer)
    order = [name for group in STOP_ORDER for name in group]
    assert sorted(order) == sorted(compose)


def test_docs_show_the_example_client_verbatim():
    example = (REPO / "examples" / "grpc_client.py").read_text()
    assert f"```python\n{example}```" in (REPO / "docs" / "mesh.md").read_text()


def test_every_service_is_traced_and_scraped():
    compose = _radixmesh_services()
    everything = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    assert "4317:4317" in everything["jaeger"]["ports"]
    assert everything["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    mount = everything["prometheus"]["volumes"][0]
    assert mount.startswith("./deploy/prometheus.yml:/etc/prometheus/prometheus.yml")
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for group in job["static_configs"]
               for t in group["targets"]}
    expected = set()
    for name, _ in TOPOLOGY:
        svc = compose[name]
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
        flags_from_dataclass(load_ref(CONFIG_CLASSES[name]), parser)
        config = config_from_args(load_ref(CONFIG_CLASSES[name]), parser.parse_args(svc["command"][2:]))
        # the gateway serves /metrics on its HTTP port; the others on --metrics-port
        port = config.http_port if name == "gateway" else config.common.metrics_port
        assert port is not None, f"{name} has no --metrics-port"
        expected.add(f"{name}:{port}")
    assert targets == expected
