"""The worker's expert metrics, read at scrape time: how the MoE router spreads tokens over the
experts, and (expert parallel) how unevenly that loads the ranks and what rebalancing cost.

    radixmesh:expert_tokens_total{layer, expert}   tokens routed to each logical expert since the
                                                   model loaded (counts of the top-k choices: a
                                                   layer's row adds up to tokens x num_experts_per_tok)
    radixmesh:expert_imbalance                     max over mean tokens per EP rank, averaged over
                                                   layers, since the placement last changed
    radixmesh:expert_rebalances_total              EPLB rebalances run
    radixmesh:expert_rebalance_last_seconds        the last one's time, all its pauses together
    radixmesh:expert_rebalance_longest_pause_seconds  the longest one step waited for a rebalance
    radixmesh:expert_moved_weights_total           expert weights that crossed ranks, all rebalances

Nothing for a dense model; the imbalance only with --ep-size > 1 once a token was routed, the
rebalance series only with --ep-size > 1. The recorder (services/worker/model/expert_load.py)
keeps counting on the model's device; the hot path does nothing for this collector.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import LABELS, PREFIX


class ExpertCollector(Collector):
    def __init__(self, model_name: Callable[[], str | None], runner: Callable[[], object | None]) -> None:
        """model_name: None while the model loads (nothing is exported); runner: the ModelRunner
        (or a group's leader), whose expert_load and expert_parallel are read at each scrape."""
        self._model_name, self._runner = model_name, runner

    def collect(self) -> Iterator[Metric]:
        model, runner = self._model_name(), self._runner()
        recorder = getattr(runner, "expert_load", None) if model is not None else None
        if recorder is None:  # loading, or a dense model
            return
        yield tokens_family(model, recorder)
        ep = getattr(runner, "expert_parallel", None)
        if ep is not None:
            yield from rebalance_families(model, ep.rebalancer)

    def describe(self) -> list:
        return []  # the families depend on the model: skip the registry's duplicate check


def tokens_family(model: str, recorder) -> CounterMetricFamily:
    """One counter per (MoE layer, logical expert) from recorder.total."""
    # The scrape runs on the event loop's thread while the step thread adds to these counts in
    # place. On CPU, .cpu() is the tensor itself and tolist() reads each aligned int64 whole: a
    # value is from before or after a step's add, never torn, and every series only grows (a row
    # read mid-add may briefly not add up to tokens x k). On CUDA, .cpu() copies on this thread's
    # stream after the work queued before it: the scrape waits for at most the step in flight.
    counts = recorder.total.counts.cpu().tolist()  # [moe layers][experts]
    family = CounterMetricFamily(PREFIX + "expert_tokens", "tokens the MoE router sent to each logical expert "
                                 "(top-k choices), per decoder layer, since the model loaded",
                                 labels=(*LABELS, "layer", "expert"))
    for layer, row in zip(recorder.layers, counts):
        for expert, n in enumerate(row):
            family.add_metric([model, str(layer), str(expert)], n)
    return family


def rebalance_families(model: str, rebalancer) -> Iterator[Metric]:
    """The imbalance gauge (once a token was routed) and EPLB's counters (ExpertRebalancer)."""
    imbalance = rebalancer.imbalance()
    if imbalance is not None:
        yield _one(GaugeMetricFamily, model, "expert_imbalance", "max over mean tokens per expert-parallel rank, "
                   "averaged over MoE layers, since the expert placement last changed (1 = even)", imbalance)
    stats = rebalancer.stats
    yield _one(CounterMetricFamily, model, "expert_rebalances", "EPLB rebalances of the expert placement",
               stats.rebalances)
    yield _one(GaugeMetricFamily, model, "expert_rebalance_last_seconds",
               "the last rebalance's time (placement and weight moves, all its pauses together)", stats.last_seconds)
    yield _one(GaugeMetricFamily, model, "expert_rebalance_longest_pause_seconds",
               "the longest a forward pass waited for a rebalance (a plan, or packing and unpacking a few "
               "expert weights), all rebalances", stats.longest_pause_s)
    yield _one(CounterMetricFamily, model, "expert_moved_weights",
               "expert weights this rank received from another rank, all rebalances", stats.moved_experts)


def _one(kind: type, model: str, name: str, doc: str, value: float) -> Metric:
    family = kind(PREFIX + name, doc, labels=LABELS)
    family.add_metric([model], value)
    return family
