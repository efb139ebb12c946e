"""A tiny grpc.health.v1 probe for containers: exit 0 when the target reports SERVING.

    python -m gyre.grpcx.healthcheck HOST:PORT [--service NAME] [--timeout-s 2]

Docker Compose healthchecks run it inside each service's container (Kubernetes uses its
native ``grpc:`` probes instead). Exit status: 0 SERVING, 1 anything else (NOT_SERVING,
unknown service, unreachable, deadline exceeded), 2 bad arguments. Plain synchronous grpc:
no event loop, no Gyre config, so it starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout_s: float = 2.0) -> tuple[bool, str]:
    """(serving, what was seen) for ``service`` ("" = the whole server) at ``target``."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            return False, f"{getattr(code, 'name', code)}: {err.details() if hasattr(err, 'details') else err}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.grpcx.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help='service name, e.g. "gyre.v1.Router" (default: the server)')
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the check, seconds")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be > 0")
    ok, seen = check(args.target, args.service, args.timeout_s)
    print(f"{args.target}: {seen}", file=sys.stderr if not ok else sys.stdout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
