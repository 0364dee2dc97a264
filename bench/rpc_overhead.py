"""Unary call latency through the full Omni-Flow runtime against bare grpc.aio.

Ours: the worker's GetLoad served by ServiceHost (handlers wrapped with tracing, metrics,
the error table and the deadline context; health; reflection) and called through
``open_channel`` (deadline, tracing, bounded calls in flight). Two tracing set-ups:

- recording: the OpenTelemetry SDK installed, every call makes a CLIENT and a SERVER
  span, no exporter ("tracing on, exporter off");
- default: what a service runs with when no exporter is configured — no span recorded,
  the W3C context still injected and extracted on every hop.

Reference: the same servicer on a bare ``grpc.aio.server()`` called through a bare
``grpc.aio.insecure_channel``. Everything runs in this process on 127.0.0.1, ours and
the reference interleaved in blocks so that machine noise hits both alike.
Target: ratio <= 1.3 at p50.

Security: the same runtime with mutual TLS and auth on (a second ServiceHost with a
certificate from a local CA, a client certificate and a tenant token, the policy checked
on every call) against the plaintext runtime, in the default tracing set-up.
Target: ratio <= 1.2 at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from omniflow import telemetry
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.config import SecuritySettings, load_settings
from omniflow.localredis import start_redis
from omniflow.rpc.client import open_channel
from omniflow.rpc.server import ServiceHost
from omniflow.security.bundle import make_bundle
from omniflow.security.identity import Identity
from omniflow.security.transport import Security
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.server import WorkerApp, WorkerServicer


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed_calls(stub: worker_pb2_grpc.WorkerServiceStub, n: int, out: list[float]) -> None:
    request = worker_pb2.GetLoadRequest()
    for _ in range(n):
        t0 = time.perf_counter()
        await stub.GetLoad(request)
        out.append((time.perf_counter() - t0) * 1e3)


async def interleaved(ours_stub, bare_stub, calls: int, block: int, label: str):
    await timed_calls(ours_stub, 300, [])  # warm up both paths
    await timed_calls(bare_stub, 300, [])
    ours: list[float] = []
    ref: list[float] = []
    while len(ours) < calls:
        n = min(block, calls - len(ours))
        await timed_calls(ours_stub, n, ours)
        await timed_calls(bare_stub, n, ref)
        print(f"  {label}: {len(ours)}/{calls} calls each", end="\r", flush=True)
    print()
    return ours, ref


def secured_pair(folder: Path) -> tuple[Security, Security]:
    """(server, client) security: mutual TLS, auth on, a tenant token."""
    server_id, client_id = Identity("worker", "bench", "w"), Identity("client", "bench", "c")
    bundle = make_bundle(folder, [server_id, client_id], ["bench:user"])
    common = {"tls": "on", "tls_ca": str(bundle.ca)}
    server = SecuritySettings(
        **common,
        auth="on",
        tls_cert=str(bundle.certs[server_id.uri].cert),
        tls_key=str(bundle.certs[server_id.uri].key),
        tokens_file=str(bundle.tokens_file),
    )
    client = SecuritySettings(
        **common,
        tls_cert=str(bundle.certs[client_id.uri].cert),
        tls_key=str(bundle.certs[client_id.uri].key),
        token=bundle.tokens["bench:user"],
    )
    return Security.load(server), Security.load(client)


async def main(calls: int, block: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        redis = start_redis(dir=Path(tmp) / "redis")
        try:
            settings = dataclasses.replace(
                load_settings(WorkerSettings, env={}), redis_url=redis.url, metrics_port=-1
            )
            app = WorkerApp(settings)
            host = ServiceHost(app, settings)
            await host.start()
            bare = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(app), bare)
            bare_port = bare.add_insecure_port("127.0.0.1:0")
            await bare.start()
            server_sec, client_sec = secured_pair(Path(tmp) / "pki")
            s_settings = dataclasses.replace(settings, instance_id="bench-secured")
            s_host = ServiceHost(WorkerApp(s_settings), s_settings, security=server_sec)
            await s_host.start()
            secured_ch = open_channel(s_host.address, security=client_sec)
            secured_stub = worker_pb2_grpc.WorkerServiceStub(secured_ch)
            ours_ch = open_channel(host.address)
            bare_ch = grpc.aio.insecure_channel(f"127.0.0.1:{bare_port}")
            ours_stub = worker_pb2_grpc.WorkerServiceStub(ours_ch)
            bare_stub = worker_pb2_grpc.WorkerServiceStub(bare_ch)

            # No provider yet: the default set-up (context propagated, nothing recorded).
            default = await interleaved(ours_stub, bare_stub, calls, block, "default")
            secured = await interleaved(secured_stub, ours_stub, calls, block, "tls+auth")
            telemetry.setup_tracing("bench-rpc", record=True)
            recording = await interleaved(ours_stub, bare_stub, calls, block, "recording")

            await ours_ch.close()
            await secured_ch.close()
            await s_host.stop()
            await bare_ch.close()
            await bare.stop(None)
            await host.stop()
        finally:
            redis.stop()

    print(f"\nunary GetLoad round trip, {calls} calls each, 127.0.0.1, one process")
    print("| tracing set-up | metric | omni-flow runtime (ms) | bare grpc.aio (ms) | ratio |")
    print("|---|---|---|---|---|")
    for label, (ours, ref) in (("recording, exporter off", recording), ("default", default)):
        for name, a, b in (
            ("p50", statistics.median(ours), statistics.median(ref)),
            ("p99", pct(ours, 0.99), pct(ref, 0.99)),
        ):
            print(f"| {label} | {name} | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    p50 = statistics.median(recording[0]) / statistics.median(recording[1])
    print(f"target p50 ratio <= 1.3 (recording spans): {'met' if p50 <= 1.3 else 'NOT met'}")
    print(
        "\n| security (tracing default) | metric | TLS+auth (ms) | plaintext runtime (ms) | ratio |"
    )
    print("|---|---|---|---|---|")
    ours, ref = secured
    for name, a, b in (
        ("p50", statistics.median(ours), statistics.median(ref)),
        ("p99", pct(ours, 0.99), pct(ref, 0.99)),
    ):
        print(f"| mutual TLS + token + policy | {name} | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    p50 = statistics.median(ours) / statistics.median(ref)
    print(f"target p50 ratio <= 1.2 (TLS+auth): {'met' if p50 <= 1.2 else 'NOT met'}")
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--block", type=int, default=500)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.block))
