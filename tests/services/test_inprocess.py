"""In-process gRPC tests (port 0): one trace across client → coordinator → router →
worker, the router's view of workers, and bad arguments getting INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from inprocess import host_settings
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from omniflow import telemetry
from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.rpc.client import open_channel
from omniflow.rpc.server import ServiceHost
from omniflow_services.coordinator.config import CoordinatorSettings
from omniflow_services.coordinator.server import CoordinatorApp
from omniflow_services.router.config import RouterSettings
from omniflow_services.router.server import RouterApp
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.server import WorkerApp

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def _tracing() -> None:
    telemetry.setup_tracing("omniflow-tests", exporter=EXPORTER)


@pytest.fixture
async def cluster(private_redis, tmp_path) -> AsyncIterator[dict[str, ServiceHost]]:
    hosts: dict[str, ServiceHost] = {}
    url = private_redis.url
    llm = host_settings(
        WorkerSettings,
        url,
        instance_id="llm-0",
        role="llm",
        model="tiny:qwen2",
        models_dir=str(tmp_path / "models"),
        kv_cache_bytes=4 * 1024 * 1024,
    )
    try:
        for name, app in [
            ("llm", WorkerApp(llm)),
            (
                "enc",
                WorkerApp(host_settings(WorkerSettings, url, instance_id="enc-0", role="encoder")),
            ),
            ("router", RouterApp(host_settings(RouterSettings, url, instance_id="router-0"))),
            (
                "coord",
                CoordinatorApp(host_settings(CoordinatorSettings, url, instance_id="coord-0")),
            ),
        ]:
            hosts[name] = ServiceHost(app, app.settings)
            await hosts[name].start()
        yield hosts
    finally:
        for host in reversed(list(hosts.values())):
            await host.stop()


async def test_one_trace_from_client_through_coordinator_and_router(cluster):
    EXPORTER.clear()
    tracer = telemetry.tracer()
    async with open_channel(cluster["coord"].address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with tracer.start_as_current_span("client-request") as root:
            reply = await stub.GetCluster(coordinator_pb2.GetClusterRequest())
    assert dict(reply.workers_per_role) == {"llm": 1, "encoder": 1}
    assert all(w.healthy for w in reply.workers)

    trace_id = root.get_span_context().trace_id
    spans = [s for s in EXPORTER.get_finished_spans() if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in spans}
    names = [(s.name, s.kind) for s in spans]
    coord_method = "/omniflow.api.coordinator.v1.CoordinatorService/GetCluster"
    router_method = "/omniflow.api.router.v1.RouterService/ListWorkers"
    load_method = "/omniflow.api.worker.v1.WorkerService/GetLoad"
    for method in (coord_method, router_method):
        assert (method, trace.SpanKind.CLIENT) in names
        assert (method, trace.SpanKind.SERVER) in names
    assert names.count((load_method, trace.SpanKind.SERVER)) == 2

    def chain(span) -> list[str]:
        out = []
        while span is not None:
            out.append(f"{span.kind.name}:{span.name.rsplit('/', 1)[-1]}")
            span = by_id.get(span.parent.span_id) if span.parent else None
        return out

    worker_server = next(s for s in spans if s.name == load_method)
    # Every hop is a child of the one before: connected, not merely the same trace id.
    assert chain(worker_server) == [
        "SERVER:GetLoad",
        "CLIENT:GetLoad",
        "SERVER:ListWorkers",
        "CLIENT:ListWorkers",
        "SERVER:GetCluster",
        "CLIENT:GetCluster",
        "INTERNAL:client-request",
    ]


async def test_router_lists_and_picks_live_workers(cluster):
    async with open_channel(cluster["router"].address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        llm = await stub.ListWorkers(router_pb2.ListWorkersRequest(role="llm"))
        assert [w.worker_id for w in llm.workers] == ["llm-0"]
        assert llm.workers[0].operations == ["generate", "logprobs", "penalties"]
        assert len(llm.workers[0].kv_namespace) == 32
        assert llm.workers[0].load.total_pages > 0
        # The page an llm worker registers prices a pull from another node (kv_aware).
        layout = cluster["llm"].app.core.llm.engine.layout
        (record,) = cluster["router"].app.table.list("llm")
        assert record.metadata["page_bytes"] == str(layout.page_bytes)
        assert record.metadata["page_size"] == str(layout.page_size)
        picked = await stub.Pick(router_pb2.PickRequest(role="encoder"))
        assert picked.worker.worker_id == "enc-0"
        assert picked.strategy == router_pb2.STRATEGY_ROUND_ROBIN

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Pick(router_pb2.PickRequest(role="diffusion"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no live worker of role 'diffusion'" in err.value.details()


async def test_unknown_argument_gets_invalid_argument_with_what_is_accepted(cluster):
    async with open_channel(cluster["router"].address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Pick(router_pb2.PickRequest(role="llm", strategy=42))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown strategy 42; accepted: STRATEGY_ROUND_ROBIN" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Pick(router_pb2.PickRequest(role=""))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "role is required" in err.value.details()


async def test_llm_worker_streams_a_reply_and_rejects_bad_input(cluster):
    from omniflow.api.common.v1 import common_pb2
    from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc

    async with open_channel(cluster["llm"].address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb2.GenerateRequest(
            text="Hello, Omni-Flow", sampling=common_pb2.SamplingParams(max_tokens=5)
        )
        chunks = [c async for c in stub.Generate(request)]
        tokens = [t for c in chunks for t in c.token_ids]
        last = chunks[-1]
        assert len(tokens) == last.usage.completion_tokens
        assert 1 <= len(tokens) <= 5
        assert last.finish_reason in (
            worker_pb2.FINISH_REASON_LENGTH,
            worker_pb2.FINISH_REASON_STOP,
        )
        assert last.usage.prompt_tokens > 0
        # Greedy twice: the same reply, and the second time the full prompt pages are cached.
        again = [c async for c in stub.Generate(request)]
        assert [t for c in again for t in c.token_ids] == tokens
        assert list(again[-1].prompt_block_hashes) == list(last.prompt_block_hashes)

        bad = [
            (worker_pb2.GenerateRequest(text=""), "the prompt is empty"),
            (
                worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[10**6])),
                "outside the vocabulary",
            ),
            (
                worker_pb2.GenerateRequest(
                    text="hi", sampling=common_pb2.SamplingParams(temperature=-1)
                ),
                "temperature",
            ),
        ]
        for req, message in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(req):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()
        # Still serving after bad input.
        assert [c async for c in stub.Generate(request)][-1].usage.completion_tokens >= 1


async def test_coordinator_lists_no_workflows_at_first(cluster):
    async with open_channel(cluster["coord"].address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        listed = await stub.ListWorkflows(coordinator_pb2.ListWorkflowsRequest())
        assert list(listed.workflows) == []


async def test_outgoing_calls_inside_a_handler_get_what_is_left_of_its_deadline():
    import time

    from omniflow.rpc import interceptors

    channel = interceptors.TracedChannel(None, default_timeout_s=10.0, max_in_flight=None)  # type: ignore[arg-type]
    # Outside a handler: the channel's default deadline.
    assert channel.call_options("/x.Y/Z", None, None)[1] == 10.0
    token = interceptors._DEADLINE.set(time.monotonic() + 0.25)
    try:
        _, inside, metadata = channel.call_options("/x.Y/Z", None, (("k", "v"),))
        explicit = channel.call_options("/x.Y/Z", 0.1, None)[1]
    finally:
        interceptors._DEADLINE.reset(token)
    assert 0 < inside <= 0.25  # what is left of the handler's own deadline
    assert explicit == 0.1  # a sooner deadline of the caller's own wins
    assert metadata[0] == ("k", "v") and metadata[1][0] == "traceparent"
