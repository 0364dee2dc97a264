"""Rotating the CA itself loses no request: real processes on mutual TLS.

Redis with a password, an echo worker, a router and a coordinator, every certificate from
one CA in one pki folder. While workflow runs go on (a channel kept open across the whole
rotation, and a new channel, so a new handshake, per run), ``omniflow certs rotate --ca``
adds a new CA to the trust bundle, renews every certificate by it, then drops the old CA.
Afterwards: no run failed; servers present certificates of the new CA; a caller holding a
certificate of the old CA is refused; a worker started after the rotation is reached by the
running coordinator over a channel it opens then (its own reloaded certificate and trust).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from pki_procs import PkiProcs, client_security, pki_procs, served_certificate

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.coordinator.v1 import coordinator_pb2_grpc
from omniflow.dsl import Workflow, register_operation
from omniflow.rpc.client import open_channel
from omniflow.security.identity import Identity
from omniflow.security.transport import Security
from omniflow.testing.launch import ServiceProc
from omniflow.values import VType

pytestmark = pytest.mark.integration

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})

NODE = "node-1"
SERVICES = {
    "echo-1": Identity("worker", NODE, "echo-1"),
    "echo-2": Identity("worker", NODE, "echo-2"),
    "router": Identity("router", NODE, "router"),
    "coordinator": Identity("coordinator", NODE, "coordinator"),
}
CLIENT = Identity("client", "laptop", "cli")
OMNIFLOW = str(Path(sys.executable).with_name("omniflow"))


@dataclass
class Topo:
    pki: PkiProcs
    procs: dict[str, ServiceProc]

    def security(self, cert: Path | None = None, key: Path | None = None) -> Security:
        bundle = self.pki.bundle
        return client_security(bundle, CLIENT, bundle.tokens[":admin"], cert, key)


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topo]:
    folder = tmp_path_factory.mktemp("carot")
    with pki_procs(folder, SERVICES, [CLIENT], [":admin"]) as pki:
        yield Topo(pki, pki.echo_control_plane())


def _workflow() -> cpb.RegisterWorkflowRequest:
    wf = Workflow("ca-rot")
    wf.output("text", wf.call("u", "echo", "upper", text=wf.input("text", VType.TEXT))["text"])
    return cpb.RegisterWorkflowRequest(graph=wf.compile())


async def _run(stub: coordinator_pb2_grpc.CoordinatorServiceStub, text: str) -> str:
    submit = cpb.SubmitRunRequest(workflow="ca-rot", inputs={"text": common_pb2.Value(text=text)})
    events = [e async for e in stub.RunWorkflow(submit, timeout=30)]
    done = events[-1].run_finished
    if done.state != cpb.RUN_STATE_SUCCEEDED:
        raise AssertionError(done.error)
    return done.outputs["text"].text


def _served_issuer(address: str, topo: Topo) -> x509.Name:
    """The issuer of the certificate a new TLS handshake with ``address`` presents."""
    issued = topo.pki.bundle.certs[CLIENT.uri]
    return served_certificate(address, topo.pki.bundle.ca, issued.cert, issued.key).issuer


def test_ca_rotation_loses_no_request(topo: Topo) -> None:
    pki = topo.pki.folder / "pki"
    old_ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    old_client = topo.pki.folder / "old-client"
    old_client.mkdir()
    issued = topo.pki.bundle.certs[CLIENT.uri]
    for src in (issued.cert, issued.key):
        (old_client / src.name).write_bytes(src.read_bytes())
        (old_client / src.name).chmod(0o600)
    address = topo.procs["coordinator"].address
    assert _served_issuer(address, topo) == old_ca.subject
    errors: list[str] = []
    counts = {"kept": 0, "new": 0}
    stop = threading.Event()

    def traffic() -> None:
        async def loop() -> None:
            async with open_channel(address, security=topo.security()) as kept:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(kept)
                await stub.RegisterWorkflow(_workflow())
                while not stop.is_set():
                    try:
                        assert await _run(stub, "kept") == "KEPT"
                        counts["kept"] += 1
                    except Exception as exc:
                        errors.append(f"kept channel: {exc}")
                    try:
                        async with open_channel(address, security=topo.security()) as fresh:
                            fstub = coordinator_pb2_grpc.CoordinatorServiceStub(fresh)
                            assert await _run(fstub, "new") == "NEW"
                        counts["new"] += 1
                    except Exception as exc:
                        errors.append(f"new channel: {exc}")

        asyncio.run(loop())

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        time.sleep(1.5)
        rotated = subprocess.run(
            [OMNIFLOW, "certs", "rotate", "--ca", "--dir", str(pki), "--wait-s", "2"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert rotated.returncode == 0, rotated.stdout + rotated.stderr
        steps = [json.loads(line) for line in rotated.stdout.splitlines()]
        assert [s["ca_step"] for s in steps] == ["trust", "renew", "drop"]
        assert any("/coordinator/" in u for u in steps[1]["renewed"])
        time.sleep(2.0)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors[:5]
    assert counts["kept"] > 2 and counts["new"] > 2, counts
    new_ca = x509.load_pem_x509_certificates((pki / "ca.pem").read_bytes())
    assert len(new_ca) == 1 and new_ca[0].subject != old_ca.subject
    assert not (pki / "ca-next.pem").exists() and not (pki / "ca-next.key").exists()
    for name in ("coordinator", "router", "echo-1"):
        assert _served_issuer(topo.procs[name].address, topo) == new_ca[0].subject, name
    # The old CA is dropped: its certificate is refused at the handshake.
    asyncio.run(_refused(topo, old_client / issued.cert.name, old_client / issued.key.name))
    # A worker started now, reached by the running coordinator over a channel it opens now.
    topo.procs["echo-2"] = topo.pki.start(
        "omniflow_services.worker",
        "echo-2",
        OMNIFLOW_WORKER_ROLE="echo",
        OMNIFLOW_WORKER_ENGINE="echo",
    ).wait_ready(60)
    topo.procs["echo-1"].popen.terminate()
    topo.procs["echo-1"].popen.wait(timeout=30)
    asyncio.run(_runs_on_the_new_worker(topo))


async def _refused(topo: Topo, cert: Path, key: Path) -> None:
    async with open_channel(
        topo.procs["coordinator"].address, security=topo.security(cert, key)
    ) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListWorkflows(cpb.ListWorkflowsRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def _runs_on_the_new_worker(topo: Topo) -> None:
    async with open_channel(topo.procs["coordinator"].address, security=topo.security()) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        end = time.monotonic() + 60
        while True:
            submit = cpb.SubmitRunRequest(
                workflow="ca-rot", inputs={"text": common_pb2.Value(text="x")}
            )
            events = [e async for e in stub.RunWorkflow(submit, timeout=30)]
            workers = {e.node_started.worker_id for e in events if e.HasField("node_started")}
            done = events[-1].run_finished
            if done.state == cpb.RUN_STATE_SUCCEEDED and workers == {"echo-2"}:
                return
            if time.monotonic() > end:
                raise AssertionError(f"not served by echo-2: {workers} {done.error}")
            await asyncio.sleep(0.5)
