"""The coordinator's gRPC edge."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import redis.asyncio as aioredis

from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.errors import InvalidArgument, OmniflowError, Unavailable
from omniflow.localredis import redact_url, redis_client
from omniflow.records import build
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.servicer import AppServicer
from omniflow.security.tenancy import Tenancy
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance
from omniflow_services.coordinator.caller import GrpcWorkerCaller
from omniflow_services.coordinator.catalogue import WorkflowCatalogue
from omniflow_services.coordinator.config import CoordinatorSettings
from omniflow_services.coordinator.kvhints import KVHinter
from omniflow_services.coordinator.limits import RunLimits, check_run_id
from omniflow_services.coordinator.routers import RouterPool
from omniflow_services.coordinator.runs import RunManager
from omniflow_services.coordinator.waiting import WaitingCaller

log = logging.getLogger(__name__)


class CoordinatorServicer(
    AppServicer["CoordinatorApp"], coordinator_pb2_grpc.CoordinatorServiceServicer
):
    async def RegisterWorkflow(
        self, request: coordinator_pb2.RegisterWorkflowRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterWorkflowResponse:
        if not request.HasField("graph"):
            raise InvalidArgument("graph is required")
        await self.app.tenancy().claim_workflow(request.graph.name)
        version = await self.app.catalogue().register(request.graph)
        log.info("registered workflow %s v%d", request.graph.name, version)
        return coordinator_pb2.RegisterWorkflowResponse(name=request.graph.name, version=version)

    async def GetWorkflow(
        self, request: coordinator_pb2.GetWorkflowRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetWorkflowResponse:
        await self.app.tenancy().check_workflow(request.name)
        graph = await self.app.catalogue().get(request.name, request.version)
        return coordinator_pb2.GetWorkflowResponse(graph=graph)

    async def SubmitRun(
        self, request: coordinator_pb2.SubmitRunRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.SubmitRunResponse:
        return coordinator_pb2.SubmitRunResponse(run_id=await self._submit(request))

    async def RunWorkflow(
        self, request: coordinator_pb2.SubmitRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.RunEvent]:
        runs = self.app.runs()
        run_id = await self._submit(request)
        async for event in runs.events(run_id, tenant=runs.caller_tenant()):
            yield event

    async def StreamRunEvents(
        self, request: coordinator_pb2.StreamRunEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.RunEvent]:
        tenant = await self.app.tenancy().check_run(request.run_id)
        async for event in self.app.runs().events(request.run_id, request.from_seq, tenant):
            yield event

    async def GetRun(
        self, request: coordinator_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetRunResponse:
        tenant = await self.app.tenancy().check_run(request.run_id)
        run = await self.app.runs().get(request.run_id, tenant)
        return coordinator_pb2.GetRunResponse(run=run)

    async def CancelRun(
        self, request: coordinator_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CancelRunResponse:
        tenant = await self.app.tenancy().check_run(request.run_id)
        state = await self.app.runs().cancel(request.run_id, request.reason, tenant)
        return coordinator_pb2.CancelRunResponse(state=state)  # type: ignore[arg-type]

    async def _submit(self, request: coordinator_pb2.SubmitRunRequest) -> str:
        """Claim the run's id (:meth:`_claim`) and start it; its id (SubmitRun, RunWorkflow)."""
        run_id = await self._claim(request)
        return await self.app.runs().submit(
            request.workflow,
            request.version,
            request.inputs,
            request.deadline_ms,
            run_id,
            request.node_params,
        )

    async def _claim(self, request: coordinator_pb2.SubmitRunRequest) -> str:
        """The run's id, owned by the caller's tenant (auth on); its workflow visible to it."""
        if request.run_id:
            check_run_id(request.run_id)  # before anything is written under it
        tenancy = self.app.tenancy()
        await tenancy.check_workflow(request.workflow)
        return await tenancy.claim_run(request.run_id)

    async def ListWorkflows(
        self, request: coordinator_pb2.ListWorkflowsRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListWorkflowsResponse:
        found = await self.app.catalogue().list()
        seen = await self.app.tenancy().visible(w.name for w in found)
        found = [w for w in found if w.name in seen]
        return coordinator_pb2.ListWorkflowsResponse(
            workflows=[
                coordinator_pb2.WorkflowSummary(
                    name=w.name, latest_version=w.latest_version, description=w.description
                )
                for w in found
            ]
        )

    async def GetCluster(
        self, request: coordinator_pb2.GetClusterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetClusterResponse:
        address, stub = await self.app.router()
        try:
            reply = await stub.ListWorkers(router_pb2.ListWorkersRequest())
        except OmniflowError as exc:  # whatever it was, the router is what failed
            raise Unavailable(f"router at {address}: {exc}") from exc
        per_role: dict[str, int] = {}
        for w in reply.workers:
            per_role[w.role] = per_role.get(w.role, 0) + 1
        return coordinator_pb2.GetClusterResponse(
            workers=reply.workers, router_address=address, workers_per_role=per_role
        )


class CoordinatorApp(ServiceApp):
    """Runs workflow graphs; sees the cluster through the router."""

    name = "coordinator"

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None
        self._redis: aioredis.Redis | None = None
        self._routers: RouterPool | None = None
        self._runs: RunManager | None = None
        self._caller: GrpcWorkerCaller | None = None

    def tenancy(self) -> Tenancy:
        if self._redis is None:
            raise Unavailable("coordinator is starting")
        return Tenancy(self._redis)

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            CoordinatorServicer(self), server
        )
        return [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._redis = redis_client(self.settings.redis_url, self.settings.call_timeout_s)
        try:
            await self._redis.ping()
        except Exception as exc:
            where = redact_url(self.settings.redis_url)
            raise Unavailable(f"Redis at {where} does not answer: {exc}") from exc
        self._routers = RouterPool(
            self._list_routers,
            fixed=self.settings.router_addr,
            call_timeout_s=self.settings.call_timeout_s,
        )
        self._caller = GrpcWorkerCaller(
            self._router_stub,
            pick_timeout_s=self.settings.pick_timeout_s,
            call_timeout_s=self.settings.node_timeout_s,
            hinter=KVHinter(self._workers, max_prompt_bytes=self.settings.max_prompt_bytes),
        )
        caller = WaitingCaller(self._caller, wait_s=self.settings.worker_wait_s)
        s = self.settings
        self._runs = RunManager(
            self._redis,
            caller,
            owner_id=runtime.instance_id,
            max_runs=s.max_runs,
            run_ttl_s=s.run_ttl_s,
            max_inline_bytes=s.max_inline_bytes,
            lease_ttl_s=max(s.registration_ttl_s, 1.0),
            record_retry_s=s.record_retry_s,
            resume_orphans=s.resume_orphans,
            limits=build(RunLimits, s),  # from the settings of the same names
            roles_served=self._roles_served,
        )
        await self._runs.start()

    def runs(self) -> RunManager:
        assert self._runs is not None, "started"
        return self._runs

    async def _workers(self) -> list[WorkerRecord]:
        assert self.runtime is not None
        return [worker_from_instance(i) for i in await self.runtime.registry.list(WORKER_SERVICE)]

    async def _roles_served(self) -> set[str]:
        """The roles a healthy worker serves now, as the router sees them (its health checks
        say whether a worker answers, which a discovery entry alone does not)."""
        stub = await self._router_stub()
        reply = await stub.ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=self.settings.pick_timeout_s
        )
        return {w.role for w in reply.workers if w.healthy}

    async def _router_stub(self) -> router_pb2_grpc.RouterServiceStub:
        assert self._routers is not None, "started"
        return self._routers.stub  # type: ignore[return-value]  # fails over between routers

    async def _list_routers(self) -> list[str]:
        assert self.runtime is not None
        return [i.address for i in await self.runtime.registry.list("router")]

    def catalogue(self) -> WorkflowCatalogue:
        return self.runs().catalogue  # one catalogue: its graph cache serves runs too

    async def router(self) -> tuple[str, router_pb2_grpc.RouterServiceStub]:
        """The router in use (from settings or discovery) and a stub that fails over."""
        assert self._routers is not None, "started"
        address, _ = await self._routers.current()
        return address, self._routers.stub  # type: ignore[return-value]

    async def stop(self) -> None:
        if self._runs is not None:
            await self._runs.stop()
        if self._caller is not None:
            await self._caller.close()
        if self._routers is not None:
            await self._routers.close()
        if self._redis is not None:
            await self._redis.aclose()
