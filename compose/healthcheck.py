#!/usr/bin/env python3
"""Container health probe: exit 0 when the local service answers SERVING, else 1.

Installed in every image as ``omniflow-healthcheck``. It calls the standard
``grpc.health.v1.Health/Check`` on ``ADDRESS`` (default ``127.0.0.1:$OMNIFLOW_PORT``)
for the overall server status (service name ""), so a service that is still starting
(NOT_SERVING until registered) or shutting down counts as unhealthy. The gateway speaks
HTTP: where ``OMNIFLOW_GATEWAY_PORT`` is set (or ADDRESS is an ``http://`` URL) the probe
is ``GET /health``, healthy on 200.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(address: str) -> grpc.Channel:
    """Plaintext, or mutual TLS with the service's own certificate when OMNIFLOW_TLS=on."""
    if os.environ.get("OMNIFLOW_TLS", "off") != "on":
        return grpc.insecure_channel(address)
    files = [os.environ[v] for v in ("OMNIFLOW_TLS_CA", "OMNIFLOW_TLS_KEY", "OMNIFLOW_TLS_CERT")]
    ca, key, cert = (Path(f).read_bytes() for f in files)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))


def check(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """One health check; returns (healthy, what was seen)."""
    with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    """``GET url/health``; healthy on 200."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except OSError as exc:
        return False, f"unreachable: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "address", nargs="?", default=None, help="host:port; default 127.0.0.1:$OMNIFLOW_PORT"
    )
    parser.add_argument("--service", default="", help='health service name; "" = whole server')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait")
    args = parser.parse_args(argv)
    address = args.address
    gateway_port = os.environ.get("OMNIFLOW_GATEWAY_PORT", "")
    if address is None and gateway_port.isdigit() and int(gateway_port):
        address = f"http://127.0.0.1:{gateway_port}"
    if address is not None and address.startswith("http://"):
        healthy, seen = check_http(address, args.timeout)
        print(f"{address}: {seen}", file=sys.stdout if healthy else sys.stderr)
        return 0 if healthy else 1
    if address is None:
        port = os.environ.get("OMNIFLOW_PORT", "")
        if not port.isdigit() or int(port) == 0:
            print(f"OMNIFLOW_PORT={port!r}: a fixed port is needed to probe", file=sys.stderr)
            return 1
        address = f"127.0.0.1:{port}"
    healthy, seen = check(address, args.service, args.timeout)
    print(f"{address}: {seen}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
