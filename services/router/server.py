"""The router's gRPC edge: RouterService over the worker table fed by discovery."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.convert import strategy_name, strategy_value, worker_info
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.status import unimplemented
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance
from omniflow_services.router.config import RouterSettings
from omniflow_services.router.core import WorkerTable

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, app: RouterApp) -> None:
        self.app = app

    async def Pick(
        self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PickResponse:
        strategy = strategy_name(request.strategy, self.app.settings.default_strategy)
        worker = self.app.table.pick(
            request.role, strategy, request.exclude_worker_ids, request.operation
        )
        return router_pb2.PickResponse(
            worker=worker_info(worker), strategy=strategy_value(strategy)
        )

    async def ReportOutcome(
        self, request: router_pb2.ReportOutcomeRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReportOutcomeResponse:
        raise unimplemented("circuit breakers of the Control Flow router")

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        workers = self.app.table.list(request.role)
        loads = await asyncio.gather(*(self.app.load_of(w) for w in workers))
        infos = []
        for w, load in zip(workers, loads, strict=True):
            info = worker_info(w, healthy=load is not None)
            if load is not None:
                info.load.CopyFrom(load)
            infos.append(info)
        return router_pb2.ListWorkersResponse(workers=infos)


class RouterApp(ServiceApp):
    """Watches workers in discovery; answers Pick and ListWorkers."""

    name = "router"

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.table = WorkerTable()
        self._watch: asyncio.Task[None] | None = None
        self._channels: dict[str, TracedChannel] = {}

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(self), server)
        return [router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        first = asyncio.get_running_loop().create_future()
        self._watch = asyncio.create_task(self._follow(runtime, first))
        # SERVING only once the first listing of workers is in.
        await asyncio.wait_for(first, timeout=self.settings.call_timeout_s)

    async def _follow(self, runtime: Runtime, first: asyncio.Future[None]) -> None:
        while True:
            try:
                async for instances in runtime.registry.watch(WORKER_SERVICE):
                    self.table.replace(worker_from_instance(i) for i in instances)
                    log.debug("workers: %s", self.table.roles())
                    if not first.done():
                        first.set_result(None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # discovery hiccup: keep the last table, retry
                log.warning("worker watch failed (%s); retrying", exc)
                await asyncio.sleep(0.5)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, default_timeout_s=self.settings.load_timeout_s)
            self._channels[address] = channel
        return channel

    async def load_of(self, worker: WorkerRecord) -> common_pb2.WorkerLoad | None:
        """A worker's load, or None when it does not answer within the load deadline."""
        stub = worker_pb2_grpc.WorkerServiceStub(self._channel(worker.address))
        try:
            reply = await stub.GetLoad(worker_pb2.GetLoadRequest())
        except grpc.aio.AioRpcError as exc:
            log.debug("GetLoad of %s failed: %s", worker.worker_id, exc.code().name)
            return None
        return reply.load

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for channel in self._channels.values():
            await channel.close()
