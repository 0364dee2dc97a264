"""Real OTLP/gRPC from real processes: router, coordinator and an llm worker (tiny qwen2)
started with ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a receiver in this test, built on
opentelemetry-proto's TraceService. One workflow run must arrive as one connected trace:
one trace id, one root, every other span's parent received, spans from all three."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from omniflow.client import Client
from omniflow.dsl import VType, Workflow
from omniflow.models.resolve import resolve_model
from omniflow.testing.launch import ServiceProc

pytestmark = pytest.mark.integration


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, with the service.name of its resource."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            for scope in rs.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        ReceivedSpan(service, s.name, s.trace_id, s.span_id, s.parent_span_id)
                    )
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    server = grpc.aio.server()
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"http://127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _problems(spans: list[ReceivedSpan]) -> list[str]:
    """What keeps ``spans`` from being one connected trace of the three services.

    The trace enters the services once, at the coordinator's RunWorkflow. That span is a
    root, or the child of a span of the calling process (this test's, when an earlier test
    in the same process installed an SDK tracer provider): the caller exports nothing here.
    Every other span's parent must have been received.
    """
    ids = {s.span_id for s in spans}
    entries = [s for s in spans if not s.parent_span_id or s.parent_span_id not in ids]
    out = [
        f"{s.service} {s.name}: parent {s.parent_span_id.hex()} not received"
        for s in entries
        if s.parent_span_id and not s.name.endswith("/RunWorkflow")
    ]
    if len(entries) != 1:
        out.append(f"{len(entries)} entry spans: {[(s.service, s.name) for s in entries]}")
    services = {s.service for s in spans}
    for want in ("omniflow-coordinator", "omniflow-router", "omniflow-worker"):
        if want not in services:
            out.append(f"no span from {want} (have {sorted(services)})")
    return out


async def test_a_workflow_run_arrives_as_one_connected_otlp_trace(
    launch: Callable[..., ServiceProc], receiver: tuple[Receiver, str], tmp_path: Path
):
    spans, endpoint = receiver
    os.environ.pop("OTEL_SERVICE_NAME", None)  # each service names itself
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # export every 0.2 s, not every 5 s
    }
    models = tmp_path / "models"
    resolve_model("tiny:qwen2", models)
    launch(
        "omniflow_services.worker",
        "llm-0",
        OMNIFLOW_WORKER_ROLE="llm",
        OMNIFLOW_WORKER_MODEL="tiny:qwen2",
        OMNIFLOW_MODELS_DIR=str(models),
        OMNIFLOW_WORKER_KV_CONNECT="false",
        **otel,
    ).wait_ready(timeout_s=180)
    router = launch("omniflow_services.router", "router", **otel).wait_ready()
    coordinator = launch(
        "omniflow_services.coordinator",
        "coordinator",
        OMNIFLOW_ROUTER_ADDR=router.address,
        **otel,
    ).wait_ready()

    wf = Workflow("traced_otlp")
    draft = wf.call(
        "draft", "llm", "generate", prompt=wf.input("q", VType.TEXT), params={"max_tokens": 3}
    )
    polish = wf.call("polish", "llm", "generate", prompt=draft["text"], params={"max_tokens": 3})
    wf.output("answer", polish["text"])
    async with Client(coordinator.address) as client:
        await client.register(wf)
        result = await client.run("traced_otlp", {"q": "what is a page"})
        assert result.ok, result.error
        run = await client.get_run(result.run_id)
    trace_id = bytes.fromhex(run.trace_id)
    assert len(trace_id) == 16 and any(trace_id)

    problems: list[str] = ["nothing received"]
    for _ in range(300):  # the services export in batches: wait for the last one
        found = spans.trace(trace_id)
        problems = _problems(found)
        if not problems:
            break
        await asyncio.sleep(0.1)
    assert not problems, problems
    names = {(s.service, s.name) for s in found}
    assert ("omniflow-coordinator", "run traced_otlp") in names
    assert ("omniflow-coordinator", "node draft") in names
    assert ("omniflow-coordinator", "node polish") in names
    assert ("omniflow-router", "/omniflow.api.router.v1.RouterService/Pick") in names
    assert ("omniflow-worker", "/omniflow.api.worker.v1.WorkerService/Generate") in names
    # No span of the run went to another trace: every span the receiver got from these
    # services during the run that names the run's nodes is in it.
    strays = [s for s in spans.spans if s.name.startswith("node ") and s.trace_id != trace_id]
    assert not strays, strays
