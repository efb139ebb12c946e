"""A tiny grpc.health.v1 probe for containers: exit 0 when the target reports SERVING.

    python -m gyre.grpcx.healthcheck HOST:PORT [--tls-dir DIR] [--service NAME] [--timeout-s 2]

Docker Compose healthchecks run it inside each service's container with the container's
own identity (``--tls-dir``, or ``$GYRE_HEALTHCHECK_TLS_DIR``: every Gyre port requires
mutual TLS); without one it dials plaintext, which only a plaintext health port
(``health_port``, what Kubernetes' native ``grpc:`` probes use) or a ``tls.insecure``
server answers. Exit status: 0 SERVING, 1 anything else (NOT_SERVING, unknown service,
unreachable, refused handshake, deadline exceeded), 2 bad arguments. Plain synchronous
grpc: no event loop, no Gyre config, so it starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(target: str, tls_dir: str, server_name: str) -> grpc.Channel:
    if not tls_dir:
        return grpc.insecure_channel(target)

    def read(name: str) -> bytes:
        with open(os.path.join(tls_dir, name), "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(read("ca.crt"), read("tls.key"), read("tls.crt"))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(target, creds, options=options)


def check(
    target: str, service: str = "", timeout_s: float = 2.0, tls_dir: str = "", server_name: str = ""
) -> tuple[bool, str]:
    """(serving, what was seen) for ``service`` ("" = the whole server) at ``target``."""
    with _channel(target, tls_dir, server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            return (
                False,
                f"{getattr(code, 'name', code)}: {err.details() if hasattr(err, 'details') else err}",
            )
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gyre.grpcx.healthcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument("target", help="host:port of the gRPC server")
    parser.add_argument(
        "--service", default="", help='service name, e.g. "gyre.v1.Router" (default: the server)'
    )
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the check, seconds")
    parser.add_argument(
        "--tls-dir",
        default=os.environ.get("GYRE_HEALTHCHECK_TLS_DIR", ""),
        help="identity directory (tls.crt, tls.key, ca.crt) to dial with mutual TLS",
    )
    parser.add_argument(
        "--server-name", default="", help="name the server certificate must carry (default: the dialed host)"
    )
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be > 0")
    ok, seen = check(args.target, args.service, args.timeout_s, args.tls_dir, args.server_name)
    print(f"{args.target}: {seen}", file=sys.stderr if not ok else sys.stdout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
