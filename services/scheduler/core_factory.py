"""The scheduler core from what its worker says about itself (radixmesh.v1.WorkerInfo).

The one composition root of a replica's scheduling side: the scheduler service builds its core
here from the worker's GetInfo answer, and the in-process Engine from the same message built for
its own runner (services/worker/info.py), so model limits, the cap on running requests and the
adapters are derived once, the same way for both.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from services.common.hicache_config import HiCacheConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.disaggregation import DisaggregationConfig
from services.scheduler.hicache import StoreProbe
from services.scheduler.scheduler import ModelLimits, Scheduler

log = logging.getLogger(__name__)


def model_limits(info) -> ModelLimits:
    """info: a radixmesh.v1.WorkerInfo."""
    m = info.model
    return ModelLimits(info.num_kv_pages, info.page_size, m.max_position_embeddings, m.vocab_size,
                       tuple(m.eos_token_ids), info.num_host_pages, info.page_bytes, info.model_identity,
                       info.weights_version or "0", info.kv_layout, info.max_draft_tokens, info.verify_max_rows,
                       info.max_loras)


def fit_config(config: SchedulerConfig, info) -> SchedulerConfig:
    """`config` with max_running_requests capped to the worker's page-table rows (with a warning)."""
    rows = info.max_requests
    if rows and config.max_running_requests > rows:
        log.warning("capping max_running_requests to the worker's page-table rows",
                    extra={"requested": config.max_running_requests, "worker_max_requests": rows})
        return replace(config, max_running_requests=rows)
    return config


def build_core(config: SchedulerConfig, info, hicache: HiCacheConfig | None = None,
               store: StoreProbe | None = None, disaggregation: DisaggregationConfig | None = None) -> Scheduler:
    """A fresh core for the worker `info` describes (its config already fitted)."""
    return Scheduler(config, model_limits(info), hicache, store, {a.name: a.identity for a in info.adapters},
                     disaggregation)
