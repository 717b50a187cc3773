"""Optional TLS and mutual TLS for the mesh's internal gRPC (off by default: loopback, plaintext).

Server side (CommonConfig, every service): `--tls-cert` + `--tls-key` serve TLS;
adding `--tls-client-ca` requires every client to present a certificate signed by
that CA (mTLS: a client without one fails the handshake, before any RPC).
Client side (the same process's outbound channels): `--tls-ca` turns TLS on and
verifies servers against that CA; `--tls-client-cert` + `--tls-client-key` are the
certificate presented to mTLS servers. The two sides are separate flags because a
process is usually both: a TLS-only fleet sets `--tls-ca` on clients without
servers requiring client certificates; an mTLS fleet sets `--tls-client-ca` too.

Every outbound channel is made here (`aio_channel`, `sync_channel`), with the
process's client settings, which `run_service` installs once from CommonConfig
(`configure_clients`) before anything dials: call sites stay one line and no
constructor threads TLS options through. Server certificates must name the host
the clients dial (`scripts/make_test_ca.sh` makes localhost / 127.0.0.1 ones).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import grpc


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class ServerTLS:
    cert: str                     # PEM certificate chain of this server
    key: str                      # PEM private key
    client_ca: str | None = None  # PEM CA bundle client certificates must chain to; None = no client certs

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca) if self.client_ca else None,
            require_client_auth=self.client_ca is not None)

    @property
    def mode(self) -> str:
        return "mtls" if self.client_ca else "tls"


@dataclass(frozen=True)
class ClientTLS:
    ca: str                   # PEM CA bundle that server certificates must chain to
    cert: str | None = None   # PEM certificate presented to servers that require one
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca),
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)


def server_tls(config: Any) -> ServerTLS | None:
    """The server settings of a CommonConfig (anything with its tls_* fields), None = plaintext."""
    cert = getattr(config, "tls_cert", None)
    return ServerTLS(cert, config.tls_key, getattr(config, "tls_client_ca", None)) if cert else None


def client_tls(config: Any) -> ClientTLS | None:
    """The client settings of a CommonConfig, None = plaintext channels."""
    ca = getattr(config, "tls_ca", None)
    return ClientTLS(ca, getattr(config, "tls_client_cert", None), getattr(config, "tls_client_key", None)) \
        if ca else None


_clients: ClientTLS | None = None  # this process's outbound settings (configure_clients)


def configure_clients(settings: ClientTLS | None) -> None:
    """Set the TLS every later channel of this process uses (None = plaintext)."""
    global _clients
    _clients = settings


def configured_clients() -> ClientTLS | None:
    return _clients


def _credentials(settings: ClientTLS | None) -> grpc.ChannelCredentials | None:
    settings = settings or _clients
    return settings.credentials() if settings is not None else None


def aio_channel(address: str, options: Iterable[tuple[str, Any]] | None = None,
                interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
                settings: ClientTLS | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS with `settings` (default: the process's), else plaintext."""
    creds, opts = _credentials(settings), list(options or ())
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)


def sync_channel(address: str, options: Iterable[tuple[str, Any]] | None = None,
                 settings: ClientTLS | None = None) -> grpc.Channel:
    """A blocking channel to `address`, as aio_channel."""
    creds, opts = _credentials(settings), list(options or ())
    return grpc.insecure_channel(address, options=opts) if creds is None else \
        grpc.secure_channel(address, creds, options=opts)


def add_port(server: grpc.aio.Server, listen: str, settings: ServerTLS | None) -> int:
    """Bind `listen` with TLS when `settings` is given; returns the bound port (0 = failed)."""
    if settings is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, settings.credentials())


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The client flags, for tools outside CommonConfig (healthcheck, the launcher's probes)."""
    parser.add_argument("--tls-ca", default=None, help="verify servers against this PEM CA (turns TLS on)")
    parser.add_argument("--tls-client-cert", default=None, help="PEM certificate for servers that require one")
    parser.add_argument("--tls-client-key", default=None, help="its PEM private key")


def client_from_argv(argv: list[str]) -> ClientTLS | None:
    """The client flags found in `argv` (others ignored), e.g. in flags forwarded to services."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_client_flags(parser)
    return client_tls(parser.parse_known_args(argv)[0])
