"""services/common/config.py flag generation and services/common/logging.py JSON lines."""
from __future__ import annotations

import argparse
import io
import json
import logging
from dataclasses import dataclass, field

import pytest

from services.common.config import CommonConfig, config_from_args, flags_from_dataclass, parse_config
from services.common.logging import request_context, setup_logging


@dataclass(frozen=True)
class Core:
    """Stands in for a core config (SchedulerConfig): no transport options."""

    max_running: int = field(default=64, metadata={"help": "requests at once"})
    ratio: float = 0.5
    policy: str = field(default="lpm", metadata={"choices": ["fcfs", "lpm"]})
    disable_cache: bool = False
    cap: int | None = 1024
    model: str | None = None
    stop: list[str] = field(default_factory=list)
    eos: tuple[int, ...] = (2,)


@dataclass(frozen=True)
class ServiceConfig:
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen="0.0.0.0:50052"))
    core: Core = field(default_factory=Core)
    upstream: str = field(default="127.0.0.1:50053", metadata={"help": "where to connect"})


def test_defaults_come_from_the_dataclasses_including_group_overrides() -> None:
    config = parse_config(ServiceConfig, [])
    assert config == ServiceConfig()
    assert config.common.listen == "0.0.0.0:50052"  # the service's own default, not CommonConfig's
    assert config.core.stop == [] and config.core.eos == (2,)


def test_every_type_maps_onto_a_flag() -> None:
    config = parse_config(ServiceConfig, [
        "--listen", "127.0.0.1:7000", "--drain-timeout-s", "2.5", "--log-level", "debug",
        "--metrics-port", "9100", "--max-running", "8", "--ratio", "0.25", "--policy", "fcfs",
        "--disable-cache", "--cap", "none", "--model", "m.gguf", "--stop", "a", "b",
        "--eos", "1", "7", "--upstream", "h:1"])
    assert config.common == CommonConfig("127.0.0.1:7000", 2.5, "debug", 9100)
    assert config.core == Core(8, 0.25, "fcfs", True, None, "m.gguf", ["a", "b"], (1, 7))
    assert config.upstream == "h:1"
    assert parse_config(ServiceConfig, ["--no-disable-cache"]).core.disable_cache is False


def test_help_carries_text_and_default() -> None:
    parser = flags_from_dataclass(ServiceConfig, argparse.ArgumentParser())
    text = parser.format_help()
    assert "requests at once (default: 64)" in text
    assert "--no-disable-cache" in text and "core options" in text


def test_a_percent_sign_in_help_prints_as_written() -> None:
    @dataclass
    class Warmup:
        lr: float = field(default=1e-3, metadata={"help": "peak rate (cosine, 3% warm-up)"})

    p = argparse.ArgumentParser()
    flags_from_dataclass(Warmup, p)
    assert "(cosine, 3% warm-up)" in p.format_help()


def test_no_shipped_flag_prints_a_doubled_percent_sign() -> None:
    """Help strings write "%" as it should print (the generator escapes it for argparse)."""
    from services.launcher.up import UpConfig
    from services.router.config import RouterConfig
    from services.scheduler.config import SchedulerConfig
    from services.worker.config import WorkerConfig
    for cls in (UpConfig, RouterConfig, SchedulerConfig, WorkerConfig):
        text = flags_from_dataclass(cls, argparse.ArgumentParser()).format_help()
        assert "%%" not in text, cls.__name__


def test_invalid_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--listen", "nope"], ["--policy", "random"], ["--max-running", "x"]):
        with pytest.raises(SystemExit) as exit_:
            parse_config(ServiceConfig, argv)
        assert exit_.value.code == 2
    assert "--listen must be HOST:PORT" in capsys.readouterr().err


def test_required_field_and_flag_collisions(capsys: pytest.CaptureFixture[str]) -> None:
    @dataclass(frozen=True)
    class Needs:
        model: str

    with pytest.raises(SystemExit) as exit_:
        parse_config(Needs, [])
    assert exit_.value.code == 2 and "the following arguments are required: --model" in capsys.readouterr().err
    assert parse_config(Needs, ["--model", "x"]) == Needs("x")

    @dataclass(frozen=True)
    class Clash:
        common: CommonConfig = field(default_factory=CommonConfig)
        listen: str = "x"

    with pytest.raises(ValueError, match="--listen"):
        flags_from_dataclass(Clash, argparse.ArgumentParser())


def test_config_from_args_does_not_share_mutable_defaults() -> None:
    parser = flags_from_dataclass(Core, argparse.ArgumentParser())
    a = config_from_args(Core, parser.parse_args([]))
    b = config_from_args(Core, parser.parse_args([]))
    assert a.stop == b.stop and a.stop is not b.stop


def test_json_log_lines_carry_service_request_id_and_extras() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)  # pytest's capture handlers live here
    stream = io.StringIO()
    setup_logging("scheduler", "info", stream)
    log = logging.getLogger("radixmesh.test")
    try:
        log.debug("hidden")
        with request_context("req-42"):
            log.info("admitted %d", 3, extra={"prompt_tokens": 17})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["service"] == "scheduler" and first["level"] == "info"
    assert first["msg"] == "admitted 3" and first["request_id"] == "req-42"
    assert first["prompt_tokens"] == 17 and first["ts"].endswith("Z")
    assert "request_id" not in second and "RuntimeError: boom" in second["exc"]


def test_worker_dtype_auto_resolves_by_cpu_features(monkeypatch):
    from kernels import cpu_isa
    from services.worker.config import WorkerConfig

    assert WorkerConfig(dtype="float16").resolved_dtype == "float16"
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    monkeypatch.setattr(cpu_isa, "_proc_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw", "avx512vl",
                                                                    "avx512dq", "avx512_bf16"}))
    assert WorkerConfig().resolved_dtype == "bfloat16"
    monkeypatch.setattr(cpu_isa, "_proc_flags", lambda: frozenset({"avx2", "fma"}))
    assert WorkerConfig().resolved_dtype == "float32"
    assert WorkerConfig(device="cuda").resolved_dtype == "bfloat16"
    with pytest.raises(ValueError, match="--dtype must be auto or one of"):
        WorkerConfig(dtype="int4")
