"""`radixmesh healthcheck HOST:PORT`: exit 0 when the gRPC service there is SERVING, else 1.

For container health checks and scripts; prints the status it got.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import tls


def check(address: str, service: str = "", timeout: float = 3.0, settings: tls.ClientTLS | None = None) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) or the RPC error's code name;
    over TLS with `settings` (a failed handshake reads as UNAVAILABLE)."""
    with tls.sync_channel(address, settings=settings) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a radixmesh service")
    parser.add_argument("--service", default="", help="a service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    tls.add_client_flags(parser)
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout, tls.client_tls(args))
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
