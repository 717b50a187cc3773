"""The worker's expert metrics (services/worker/expert_metrics.py), scraped from a registry as the
worker service registers them: per (layer, expert) token counters that follow the recorder's
total on a tiny random Qwen3-MoE (a layer's series add up to tokens x num_experts_per_tok more
after a step), nothing for a dense model or while loading, and with expert parallelism the
imbalance gauge and the rebalance counters of a real ExpertRebalancer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.worker.expert_metrics import ExpertCollector
from services.worker.model.expert_load import ExpertLoadRecorder
from services.worker.parallel.expert_location import ExpertLocation
from services.worker.parallel.expert_parallel import LocationHolder
from services.worker.parallel.expert_rebalance import ExpertRebalancer
from tests.unit.tiny_models import MOE, logits_by_position, runner, save_tiny

MODEL = "tiny-moe"


def scrape(runner_, model: str | None = MODEL) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ExpertCollector(lambda: model, lambda: runner_))
    return registry


def expert_tokens(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.labels["layer"], s.labels["expert"]): s.value for family in registry.collect()
            for s in family.samples if s.name == "radixmesh:expert_tokens_total"}


def test_token_counters_follow_the_total(tmp_path):
    moe = runner(save_tiny(tmp_path, "qwen3_moe")[0])
    registry = scrape(moe)
    before = expert_tokens(registry)
    assert len(before) == 2 * MOE["num_experts"] and set(before.values()) == {0}
    seqs = {"a": list(range(1, 10)), "b": list(range(30, 35))}
    logits_by_position(moe, seqs, {"a": [9], "b": [5]}, 4)
    after = expert_tokens(registry)
    counts = moe.expert_load.total.counts
    assert after == {(str(layer), str(e)): float(counts[row, e]) for row, layer in enumerate(moe.expert_load.layers)
                     for e in range(MOE["num_experts"])}
    for layer in ("0", "1"):
        assert sum(v for (row, _), v in after.items() if row == layer) == 14 * MOE["num_experts_per_tok"]
    text = generate_latest(registry).decode()
    assert f'radixmesh:expert_tokens_total{{expert="3",layer="1",model_name="{MODEL}"}}' in text
    assert "expert_imbalance" not in text and "expert_rebalances" not in text  # no expert parallelism
    assert generate_latest(scrape(moe, model=None)) == b""  # still loading


def test_a_dense_model_exports_nothing():
    assert generate_latest(scrape(SimpleNamespace(expert_load=None, expert_parallel=None))) == b""
    assert generate_latest(scrape(None)) == b""


@pytest.fixture
def expert_parallel():
    """A rank of a 2-way EP group: 8 experts spread 4 a rank, its rebalancer and recorder."""
    recorder = ExpertLoadRecorder([0, 3], 8)
    holder = LocationHolder(ExpertLocation.spread(2, 8, 2))
    rebalancer = ExpertRebalancer([], holder, recorder, rank=0, size=2, redundant=0, every=None)
    return SimpleNamespace(expert_load=recorder, expert_parallel=SimpleNamespace(rebalancer=rebalancer))


def test_imbalance_and_rebalances(expert_parallel):
    registry = scrape(expert_parallel)
    value = lambda name: registry.get_sample_value(name, {"model_name": MODEL})
    assert value("radixmesh:expert_imbalance") is None  # nothing routed yet
    assert value("radixmesh:expert_rebalances_total") == 0
    rank0 = int(ExpertLocation.spread(2, 8, 2).phy2log[0, 0])  # an expert rank 0 holds
    expert_parallel.expert_load.record(0, torch.full((6, 1), rank0))  # layer 0: every token to rank 0
    assert value("radixmesh:expert_imbalance") == pytest.approx(2.0)  # max 6 over mean 3; layer 3 idle
    stats = expert_parallel.expert_parallel.rebalancer.stats
    stats.rebalances, stats.last_seconds, stats.moved_experts = 2, 0.25, 6
    assert value("radixmesh:expert_rebalances_total") == 2
    assert value("radixmesh:expert_rebalance_last_seconds") == 0.25
    assert value("radixmesh:expert_moved_weights_total") == 6
    assert registry.get_sample_value("radixmesh:expert_tokens_total",
                                     {"model_name": MODEL, "layer": "0", "expert": str(rank0)}) == 6
