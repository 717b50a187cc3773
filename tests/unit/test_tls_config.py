"""The TLS flags every service has (CommonConfig): pairs that go together, files that must
exist, and how they become server and client settings."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.common import tls
from services.common.config import CommonConfig, parse_config


def _files(tmp_path: Path) -> dict[str, str]:
    names = ("cert", "key", "ca", "ccert", "ckey")
    for n in names:
        (tmp_path / n).write_text("-----BEGIN X-----\n")
    return {n: str(tmp_path / n) for n in names}


def test_default_is_plaintext() -> None:
    c = CommonConfig()
    assert tls.server_tls(c) is None and tls.client_tls(c) is None


def test_flags_become_server_and_client_settings(tmp_path: Path) -> None:
    f = _files(tmp_path)
    c = parse_config(CommonConfig, ["--tls-cert", f["cert"], "--tls-key", f["key"], "--tls-client-ca", f["ca"],
                                    "--tls-ca", f["ca"], "--tls-client-cert", f["ccert"],
                                    "--tls-client-key", f["ckey"]], argparse.ArgumentParser())
    assert tls.server_tls(c) == tls.ServerTLS(f["cert"], f["key"], f["ca"]) and tls.server_tls(c).mode == "mtls"
    assert tls.client_tls(c) == tls.ClientTLS(f["ca"], f["ccert"], f["ckey"])
    tls_only = CommonConfig(tls_cert=f["cert"], tls_key=f["key"])
    assert tls.server_tls(tls_only).mode == "tls" and tls.client_tls(tls_only) is None


@pytest.mark.parametrize("flags, message", [
    ({"tls_cert": "cert"}, "--tls-cert and --tls-key go together"),
    ({"tls_key": "key"}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "ca"}, "--tls-client-ca"),
    ({"tls_ca": "ca", "tls_client_cert": "ccert"}, "--tls-client-cert and --tls-client-key go together"),
    ({"tls_client_cert": "ccert", "tls_client_key": "ckey"}, "needs --tls-ca"),
])
def test_incomplete_flags_are_refused(tmp_path: Path, flags: dict[str, str], message: str) -> None:
    f = _files(tmp_path)
    with pytest.raises(ValueError, match=message):
        CommonConfig(**{k: f[v] for k, v in flags.items()})


def test_missing_files_are_named(tmp_path: Path) -> None:
    f = _files(tmp_path)
    with pytest.raises(ValueError, match="--tls-ca: no such file"):
        CommonConfig(tls_ca=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--tls-key: no such file"):
        CommonConfig(tls_cert=f["cert"], tls_key=str(tmp_path / "nope"))


def test_client_settings_from_forwarded_flags() -> None:
    argv = ["--kv-cache-bytes", "1", "--tls-client-ca", "x", "--tls-ca", "ca.pem", "--tls-client-cert", "c.pem",
            "--tls-client-key", "c.key", "--log-level", "debug"]
    assert tls.client_from_argv(argv) == tls.ClientTLS("ca.pem", "c.pem", "c.key")
    assert tls.client_from_argv(["--tls-client-ca", "x"]) is None


def test_up_forwards_every_tls_flag_to_the_gateway_too() -> None:
    """`radixmesh up` with TLS needs no --no-gateway: the gateway takes the flags as every service."""
    from services.launcher.up import route_flags
    argv = ["--tls-cert", "s.pem", "--tls-key", "s.key", "--tls-client-ca", "ca.pem", "--tls-ca", "ca.pem",
            "--tls-client-cert", "c.pem", "--tls-client-key", "c.key"]
    routed = route_flags(argv, ["worker", "scheduler", "detokenizer", "tokenizer", "gateway"])
    assert all(flags == argv for flags in routed.values()), routed
