"""bench/grpc_hop.py runs both transports end to end (a sender process each) and reports each
side's CPU per message and the ratio from the same runs."""
from __future__ import annotations

import json

import pytest

from bench import grpc_hop


def test_both_transports_report_cpu_per_message(tmp_path, capsys):
    out = tmp_path / "hop.json"
    assert grpc_hop.main(["--messages", "30", "--gap-ms", "1", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for transport in ("grpc", "raw"):
        run, = report["runs"][transport]
        assert run["send"] > 0 and run["receive"] > 0, run
    medians = report["medians_us"]
    assert report["grpc_over_raw"]["receive"] == medians["grpc"]["receive"] / medians["raw"]["receive"]
    assert "grpc / raw" in capsys.readouterr().out


def test_too_few_messages_is_refused(capsys):
    with pytest.raises(SystemExit):
        grpc_hop.main(["--messages", str(grpc_hop.WARMUP)])
    assert "--messages must be above" in capsys.readouterr().err
