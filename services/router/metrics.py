"""The router's Prometheus metrics, per replica (`replica` = its address) and `model_name`.

They live in REGISTRY, which `radixmesh serve router --metrics-port PORT` serves on /metrics
through services/common/server.py like every service's.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry()

_L = ("model_name", "replica")

ROUTED = Counter("radixmesh:router_requests_routed", "attempts sent to a replica, by why it was chosen "
                 "(decision: match = its cached prefix, load = its load or a load-only policy)", (*_L, "decision"), registry=REGISTRY)
IN_FLIGHT = Gauge("radixmesh:router_in_flight_requests", "requests the router has open on a replica", _L, registry=REGISTRY)
FAILURES = Counter("radixmesh:router_attempt_failures", "attempts that failed, by gRPC code", (*_L, "code"), registry=REGISTRY)
RETRIES = Counter("radixmesh:router_retries", "failed attempts on this replica that were retried elsewhere", _L, registry=REGISTRY)
MID_STREAM = Counter("radixmesh:router_mid_stream_failures", "streams cut after their first token", _L, registry=REGISTRY)
EJECTIONS = Counter("radixmesh:router_ejections", "times health checks ejected the replica", _L, registry=REGISTRY)
HEALTHY = Gauge("radixmesh:router_replica_healthy", "1 while the replica passes health checks", _L, registry=REGISTRY)
CIRCUIT = Gauge("radixmesh:router_circuit_state", "circuit breaker: 0 closed, 1 half-open, 2 open", _L, registry=REGISTRY)
CACHE_HIT_RATE = Gauge("radixmesh:router_replica_cache_hit_rate", "the replica's reported prefix-cache hit rate", _L, registry=REGISTRY)
PAIRS = Counter("radixmesh:router_pairs", "disaggregated fleet: pairs sent, by their prefill and decode replica",
                ("model_name", "prefill", "decode"), registry=REGISTRY)
QUEUE = Gauge("radixmesh:router_replica_queue", "the replica's reported running + waiting requests", _L, registry=REGISTRY)


def forget(model_name: str, replica: str) -> None:
    """Drop a removed replica's series."""
    for metric in (IN_FLIGHT, RETRIES, MID_STREAM, EJECTIONS, HEALTHY, CIRCUIT, CACHE_HIT_RATE, QUEUE):
        try:
            metric.remove(model_name, replica)
        except KeyError:
            pass
