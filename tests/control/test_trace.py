"""One trace per run: the run span, its node spans and every call to the router and
the workers share the trace id the run record reports (in-process coordinator and
router on port 0, echo TEST workers as real processes)."""

from __future__ import annotations

import pytest
from inprocess import host_settings
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from omniflow import telemetry
from omniflow.client import Client
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.rpc.server import ServiceHost
from omniflow_services.coordinator.config import CoordinatorSettings
from omniflow_services.coordinator.server import CoordinatorApp
from omniflow_services.router.config import RouterSettings
from omniflow_services.router.server import RouterApp

pytestmark = pytest.mark.integration

EXPORTER = InMemorySpanExporter()
register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})


@pytest.fixture(scope="module", autouse=True)
def _tracing() -> None:
    telemetry.setup_tracing("omniflow-tests", exporter=EXPORTER)


async def test_a_run_is_one_trace(launch, redis_proc):
    for name, role in (("llm-0", "llm"), ("echo-0", "echo")):
        launch(
            "omniflow_services.worker",
            name,
            OMNIFLOW_WORKER_ENGINE="echo",
            OMNIFLOW_WORKER_ROLE=role,
        ).wait_ready()
    url = redis_proc.url
    router = ServiceHost(
        RouterApp(host_settings(RouterSettings, url, instance_id="router-0")),
        host_settings(RouterSettings, url, instance_id="router-0"),
    )
    await router.start()
    coord_settings = host_settings(
        CoordinatorSettings, url, instance_id="coord-0", router_addr=router.address
    )
    coord = ServiceHost(CoordinatorApp(coord_settings), coord_settings)
    await coord.start()
    try:
        wf = Workflow("traced")
        d = wf.call("draft", "llm", "generate", prompt=wf.input("q", VType.TEXT))
        wf.output("o", wf.call("up", "echo", "upper", text=d["text"])["text"])
        async with Client(coord.address) as client:
            await client.register(wf)
            EXPORTER.clear()
            result = await client.run("traced", {"q": "hi"})
            assert result.outputs == {"o": "ECHO: HI"}
            run = await client.get_run(result.run_id)
        trace_id = int(run.trace_id, 16)
        assert trace_id
        spans = [s for s in EXPORTER.get_finished_spans() if s.context.trace_id == trace_id]
        names = {s.name for s in spans}
        assert {"run traced", "node draft", "node up"} <= names
        assert "/omniflow.api.router.v1.RouterService/Pick" in names
        assert "/omniflow.api.worker.v1.WorkerService/Generate" in names
        assert "/omniflow.api.worker.v1.WorkerService/Invoke" in names
        by_id = {s.context.span_id: s for s in spans}
        (run_span,) = [s for s in spans if s.name == "run traced"]
        for node in ("node draft", "node up"):
            (span,) = [s for s in spans if s.name == node]
            assert span.parent.span_id == run_span.context.span_id
        picks = [s for s in spans if s.name.endswith("/Pick") and s.kind.name == "CLIENT"]
        # A pick is made inside its node's span, or ahead (while the producer runs)
        # directly under the run span.
        assert len(picks) == 2
        assert all(by_id[p.parent.span_id].name in ("node draft", "run traced") for p in picks)
    finally:
        await coord.stop()
        await router.stop()
