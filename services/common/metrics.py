"""Prometheus metrics: names, buckets and the `/metrics` endpoint every service shares.

Every metric is named `radixmesh:<name>` and labelled with `model_name` (the worker's
model name, as /v1/models reports it), so one dashboard works for every deployment.
Each service owns a `CollectorRegistry` (several services can live in one test
process); `serve` exposes it over HTTP on the service's own event loop, so a
collector that reads live state at scrape time reads it between two awaits,
never half-updated. A scrape makes no spans.

    registry = CollectorRegistry()
    ttft = histogram(registry, "time_to_first_token_seconds", "...", LATENCY_BUCKETS)
    ttft.labels(model_name="SmolLM2").observe(0.12)
    runner, port = await serve(registry, "127.0.0.1", 0)   # GET http://127.0.0.1:<port>/metrics
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "radixmesh:"
LABELS = ("model_name",)
# Seconds: from a fast CPU step (ms) to a long CPU generation (minutes).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def counter(registry: CollectorRegistry, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
    """`radixmesh:<name>_total`; labels are model_name plus `labels`."""
    return Counter(PREFIX + name, doc, (*LABELS, *labels), registry=registry)


def gauge(registry: CollectorRegistry, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
    return Gauge(PREFIX + name, doc, (*LABELS, *labels), registry=registry)


def histogram(registry: CollectorRegistry, name: str, doc: str, buckets: Iterable[float],
              labels: Iterable[str] = ()) -> Histogram:
    return Histogram(PREFIX + name, doc, (*LABELS, *labels), buckets=tuple(buckets), registry=registry)


class LiveCollector(Collector):
    """Counters and gauges read at scrape time from `read()`, which returns
    {name: (kind, doc, value)} with kind "counter" or "gauge" (None skips the scrape, e.g.
    before the model is known). Used for state the core already counts (KV pages, cache hits),
    so the hot path does nothing extra."""

    def __init__(self, model_name: Callable[[], str | None],
                 read: Callable[[], dict[str, tuple[str, str, float]] | None]) -> None:
        self._model_name, self._read = model_name, read

    def collect(self):
        model = self._model_name()
        if model is None:  # `read` may need what is not there yet (the worker's model while it loads)
            return
        values = self._read()
        if values is None:
            return
        for name, (kind, doc, value) in values.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(PREFIX + name, doc,
                                                                                      labels=LABELS)
            family.add_metric([model], value)
            yield family

    def describe(self):
        return []  # names are only known at scrape time: skip the registry's duplicate check


class InfoCollector(Collector):
    """One info metric (PREFIX + name + "_info" = 1, labelled with the model and `read()`'s
    {label: value}), read at scrape time; nothing while model_name() is None."""

    def __init__(self, model_name: Callable[[], str | None], name: str, doc: str,
                 read: Callable[[], dict[str, str]]) -> None:
        self._model_name, self._name, self._doc, self._read = model_name, name, doc, read

    def collect(self):
        model = self._model_name()
        if model is None:
            return
        family = InfoMetricFamily(PREFIX + self._name, self._doc)
        family.add_metric([], {LABELS[0]: model, **self._read()})
        yield family

    def describe(self):
        return []


async def handle(registry: CollectorRegistry) -> web.Response:
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(registry: CollectorRegistry, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve GET /metrics on host:port (0 picks a free port) on the running loop.
    Returns the runner (await runner.cleanup() to stop) and the bound port. Raises OSError."""
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        return await handle(registry)

    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


def model_name_of(path: str | None) -> str:
    """The name the worker reports for the model at `path` (`model_path.model_id`), for
    services that load no weights but label metrics by model."""
    from services.common.model_path import model_id, resolve_model_path

    return model_id(resolve_model_path(path))
