"""The coordinator's gRPC edge."""

from __future__ import annotations

import logging

import grpc
import redis.asyncio as aioredis

from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.errors import Unavailable
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.status import error_from_rpc, unimplemented_servicer
from omniflow_services.coordinator.config import CoordinatorSettings
from omniflow_services.coordinator.core import WorkflowCatalogue

log = logging.getLogger(__name__)

_Pending = unimplemented_servicer(
    coordinator_pb2_grpc.CoordinatorServiceServicer,
    "workflow registration and runs (Control Flow)",
    keep=("ListWorkflows", "GetCluster"),
)


class CoordinatorServicer(_Pending):  # type: ignore[misc, valid-type]
    def __init__(self, app: CoordinatorApp) -> None:
        self.app = app

    async def ListWorkflows(
        self, request: coordinator_pb2.ListWorkflowsRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListWorkflowsResponse:
        found = await self.app.catalogue().list()
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
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"router at {address}: {error_from_rpc(exc)}") from exc
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
        self._router: tuple[str, TracedChannel] | None = None

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            CoordinatorServicer(self), server
        )
        return [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._redis = aioredis.from_url(
            self.settings.redis_url, socket_timeout=self.settings.call_timeout_s
        )
        try:
            await self._redis.ping()
        except Exception as exc:
            raise Unavailable(f"Redis at {self.settings.redis_url} does not answer: {exc}") from exc

    def catalogue(self) -> WorkflowCatalogue:
        assert self._redis is not None, "started"
        return WorkflowCatalogue(self._redis)

    async def router(self) -> tuple[str, router_pb2_grpc.RouterServiceStub]:
        """The router's address and a stub, from settings or discovery."""
        address = self.settings.router_addr
        if not address:
            assert self.runtime is not None
            routers = await self.runtime.registry.list("router")
            if not routers:
                raise Unavailable("no router is registered in discovery")
            address = routers[0].address
        if self._router is None or self._router[0] != address:
            if self._router is not None:
                await self._router[1].close()
            channel = open_channel(
                address,
                default_timeout_s=self.settings.call_timeout_s,
                idempotent=("omniflow.api.router.v1.RouterService/ListWorkers",),
            )
            self._router = (address, channel)
        return address, router_pb2_grpc.RouterServiceStub(self._router[1])

    async def stop(self) -> None:
        if self._router is not None:
            await self._router[1].close()
        if self._redis is not None:
            await self._redis.aclose()
