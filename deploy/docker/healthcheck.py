"""Container health probe for docker-compose: exit 0 when the service serves, 1 otherwise.

    healthcheck.py grpc 127.0.0.1:50051 rollgate.v1.Router   # grpc.health.v1 Check
    healthcheck.py http http://127.0.0.1:8080/ready          # HTTP 2xx

Kubernetes does not need it: its probes speak gRPC health and HTTP natively.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_serving(address: str, service: str, timeout_s: float) -> str | None:
    """None when `service` at `address` reports SERVING, else what is wrong."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return None


def http_ok(url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 2xx, else what is wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = int(response.status)
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return f"unreachable: {err}"
    return None if 200 <= status < 300 else f"HTTP {status}"


def main(argv: list[str] | None = None) -> int:
    """Runs one probe and returns the process exit code."""
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    kinds = parser.add_subparsers(dest="kind", required=True)
    grpc_probe = kinds.add_parser("grpc", help="grpc.health.v1 Check")
    grpc_probe.add_argument("address", help="host:port")
    grpc_probe.add_argument("service", nargs="?", default="", help="service name ('' = server)")
    http_probe = kinds.add_parser("http", help="HTTP GET, 2xx is healthy")
    http_probe.add_argument("url")
    args = parser.parse_args(argv)
    if args.kind == "grpc":
        problem = grpc_serving(args.address, args.service, args.timeout_s)
    else:
        problem = http_ok(args.url, args.timeout_s)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
