"""`radixmesh generate` hands its hicache flags (host tier, kvstore) to the Engine."""
from __future__ import annotations

import json
import logging

from services.common.config import config_from_args
from services.common.hicache_config import HiCacheConfig
from services.engine import cli
from services.engine.engine import EngineConfig

SMALL = ["--dtype", "float32", "--kv-cache-bytes", str(8 << 20), "--max-requests", "4",
         "--max-running-requests", "4"]


def test_the_hicache_flags_are_parsed_into_the_engine_config():
    args = cli.parser().parse_args(["hi", *SMALL, "--host-kv-ratio", "2", "--hicache-load-policy", "always",
                                    "--hicache-write-policy", "write_back", "--kvstore-timeout-s", "3"])
    assert config_from_args(EngineConfig, args).hicache == HiCacheConfig(
        host_kv_ratio=2.0, hicache_load_policy="always", hicache_write_policy="write_back", kvstore_timeout_s=3.0)


def test_generate_runs_with_the_host_tier_it_was_asked_for(caplog, capsys):
    caplog.set_level(logging.INFO)
    assert cli.main(["Hello", *SMALL, "--host-kv-ratio", "2", "--max-new-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["completion_tokens"] == 2
    tier = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hicache:")]
    assert len(tier) == 1, caplog.text
    words = tier[0].replace("(", "").split()
    host_pages, device_pages = int(words[1]), int(words[5])
    assert host_pages == 2 * device_pages > 0  # without the flag reaching it the Engine has no host tier
