"""Ids scoped to their caller and fair shares, on the secured topology (mutual TLS and auth
on, real processes): tenant B cannot abort tenant A's request by its id, a run id cannot
name another run's Redis keys, and a tenant past its share of the coordinator's runs is
refused alone, with the limit named."""

from __future__ import annotations

import os

import grpc
import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.rpc.client import open_channel
from omniflow.security.identity import Identity
from omniflow.testing.launch import start_service, stop_all
from omniflow.values import from_python

pytestmark = pytest.mark.integration

# The echo TEST worker's operations (registering one again is accepted).
register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})
register_operation(
    "echo", "sleep", {"ms": VType.INT}, {"slept_ms": VType.FLOAT, "worker": VType.TEXT}
)


def _long_generation(request_id: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=common_pb2.TokenIds(ids=list(range(5, 40))),
        sampling=common_pb2.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
    )


async def test_abort_of_another_tenants_request_id_finds_nothing(secured) -> None:
    async with (
        secured.channel("router", token="a") as a_ch,
        secured.channel("router", token="b") as b_ch,
    ):
        a = worker_pb2_grpc.WorkerServiceStub(a_ch)
        b = worker_pb2_grpc.WorkerServiceStub(b_ch)
        chunks, found_by_b = [], []
        async for chunk in a.Generate(_long_generation("shared-id"), timeout=60):
            chunks.append(chunk)
            if len(chunks) == 1:  # B knows (or guesses) A's id, and aborts it
                found_by_b.append(
                    (await b.Abort(worker_pb2.AbortRequest(request_id="shared-id"))).found
                )
        assert found_by_b == [False]
        assert chunks[0].request_id == "shared-id"  # the caller sees its own id
        assert sum(len(c.token_ids) for c in chunks) == 64
        assert chunks[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        # The control: A aborting its own request does find it, and the stream ends short.
        chunks, found_by_a = [], []
        async for chunk in a.Generate(_long_generation("shared-id"), timeout=60):
            chunks.append(chunk)
            if len(chunks) == 1:
                found_by_a.append(
                    (await a.Abort(worker_pb2.AbortRequest(request_id="shared-id"))).found
                )
        assert found_by_a == [True]
        assert sum(len(c.token_ids) for c in chunks) < 64


async def test_a_worker_bounds_a_prompt_of_token_ids(secured) -> None:
    # 300 000 ids are 1.2 MB as u32: past the worker's 1 MiB bound, refused before any work.
    request = worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[7] * 300_000),
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    async with secured.channel("router", token="a") as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(request, timeout=60):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "OMNIFLOW_WORKER_MAX_PROMPT_BYTES" in err.value.details()


def _upper(name: str) -> coordinator_pb2.RegisterWorkflowRequest:
    wf = Workflow(name)
    wf.output("text", wf.call("u", "echo", "upper", text=wf.input("text", VType.TEXT))["text"])
    return coordinator_pb2.RegisterWorkflowRequest(graph=wf.compile())


def _submit(workflow: str, run_id: str = "", **inputs: object) -> coordinator_pb2.SubmitRunRequest:
    return coordinator_pb2.SubmitRunRequest(
        workflow=workflow,
        run_id=run_id,
        inputs={k: from_python(v, k) for k, v in inputs.items()},
    )


async def test_a_run_id_cannot_name_another_runs_keys(secured) -> None:
    run = f"ids{os.getpid()}"
    async with (
        secured.channel("coordinator", token="a") as a_ch,
        secured.channel("coordinator", token="b") as b_ch,
    ):
        a = coordinator_pb2_grpc.CoordinatorServiceStub(a_ch)
        b = coordinator_pb2_grpc.CoordinatorServiceStub(b_ch)
        await a.RegisterWorkflow(_upper("ids-a"))
        await b.RegisterWorkflow(_upper("ids-b"))
        # B plants the key A's run will use for its events; then a run id too long.
        for planted in (f"{run}:events", "x" * 129, "a b"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await b.SubmitRun(_submit("ids-b", planted, text="b"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, planted
            assert "run id" in err.value.details()
        events = []
        async for ev in a.RunWorkflow(_submit("ids-a", run, text="mine"), timeout=60):
            events.append(ev)
        assert events[-1].run_finished.state == coordinator_pb2.RUN_STATE_SUCCEEDED
        assert events[-1].run_finished.outputs["text"].text == "MINE"


async def test_a_tenant_past_its_run_share_is_refused_alone(secured, tmp_path) -> None:
    ident = Identity("coordinator", "node-1", "coordinator")  # the topology's coordinator's
    proc = start_service(
        "omniflow_services.coordinator",
        "coordinator-share",
        tmp=tmp_path,
        redis_url=secured.redis.url,
        **secured.bundle.env_for(ident),
        OMNIFLOW_INSTANCE_ID=f"coordinator-share-{os.getpid()}",
        OMNIFLOW_NODE_ID=ident.node,
        OMNIFLOW_TOKEN="",
        OMNIFLOW_ROUTER_ADDR=secured.addr("router"),
        OMNIFLOW_COORDINATOR_TENANT_MAX_RUNS="2",
    )
    try:
        proc.wait_ready(60)
        wf = Workflow("share-nap")
        wf.output("w", wf.call("nap", "echo", "sleep", ms=wf.input("ms", VType.INT))["worker"])
        graph = coordinator_pb2.RegisterWorkflowRequest(graph=wf.compile())
        a_ch = open_channel(proc.address, security=secured.security("client", "a"))
        b_ch = open_channel(proc.address, security=secured.security("client", "b"))
        async with a_ch, b_ch:
            a = coordinator_pb2_grpc.CoordinatorServiceStub(a_ch)
            b = coordinator_pb2_grpc.CoordinatorServiceStub(b_ch)
            await a.RegisterWorkflow(graph)
            runs = [(await a.SubmitRun(_submit("share-nap", ms=20_000))).run_id for _ in range(2)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await a.SubmitRun(_submit("share-nap", ms=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "OMNIFLOW_COORDINATOR_TENANT_MAX_RUNS" in err.value.details()
            # Tenant B is not past its share: its run goes through meanwhile.
            await b.RegisterWorkflow(_upper("share-b"))
            events = [ev async for ev in b.RunWorkflow(_submit("share-b", text="b"), timeout=60)]
            assert events[-1].run_finished.state == coordinator_pb2.RUN_STATE_SUCCEEDED
            for run_id in runs:
                await a.CancelRun(coordinator_pb2.CancelRunRequest(run_id=run_id))
            # Its runs ended: A has its share back.
            again = await a.SubmitRun(_submit("share-nap", ms=10))
            assert again.run_id
    finally:
        stop_all([proc])
