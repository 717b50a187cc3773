"""`radixmesh healthcheck HOST:PORT`: exit 0 when the gRPC service there is SERVING, else 1.

For container health checks and scripts; prints the status it got.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) or the RPC error's code name."""
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
