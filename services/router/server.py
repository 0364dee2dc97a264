"""The router's gRPC edge: RouterService (lookaside) and WorkerService (proxy).

Lookaside: ``Pick`` names a worker; the caller calls it and tells ``ReportOutcome``.
Proxy: the router serves the worker API itself and forwards each call to a worker it
picks (role from the method, or the ``x-omniflow-role`` header for ``Invoke``; strategy
from ``x-omniflow-strategy``). A proxied call that fails with UNAVAILABLE before any
response reached the client is retried once on another worker when the method is
idempotent (``Invoke`` only when the caller says so with ``x-omniflow-idempotent: 1``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Unpack

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.convert import strategy_name, strategy_value, worker_info
from omniflow.discovery import find_address
from omniflow.errors import InvalidArgument, OmniflowError, Unavailable
from omniflow.kv.wire import read_namespace
from omniflow.routing.picker import Picker, PickOptions
from omniflow.routing.table import PickResult
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel, remaining_s
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.servicer import AppServicer
from omniflow.security.tenancy import scoped_id
from omniflow.tasks import stop_task
from omniflow.workers import WorkerRecord
from omniflow_services.router import metrics
from omniflow_services.router.config import RouterSettings

log = logging.getLogger(__name__)

# Role a proxied method goes to when the caller names none.
METHOD_ROLE = {
    "Generate": "llm",
    "Encode": "encoder",
    "GenerateImage": "diffusion",
    "Synthesize": "talker",
}
IDEMPOTENT = frozenset({"Generate", "Encode", "GenerateImage", "Synthesize", "GetInfo", "GetLoad"})


class RouterServicer(AppServicer["RouterApp"], router_pb2_grpc.RouterServiceServicer):
    async def Pick(
        self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PickResponse:
        result = await self.app.pick(
            request.role,
            request.strategy,
            exclude=tuple(request.exclude_worker_ids),
            operation=request.operation,
            session_key=request.session_key,
            namespace=read_namespace(request, "kv_namespace", optional=True),
            hashes=list(request.block_hashes),
            temperature=request.temperature,
            stored_node=request.kv_stored_node,
        )
        self.app.table.begin(result.worker.worker_id, result.prefill_blocks)
        return router_pb2.PickResponse(
            worker=worker_info(result.worker),
            strategy=strategy_value(result.strategy),  # type: ignore[arg-type]
            reachable_blocks=result.reachable_blocks,
            cost=result.cost,
            fallback_reason=result.fallback_reason,
        )

    async def ReportOutcome(
        self, request: router_pb2.ReportOutcomeRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReportOutcomeResponse:
        if not request.worker_id:
            raise InvalidArgument("worker_id is required")
        self.app.table.finish(request.worker_id, None, request.success, request.error_code)
        return router_pb2.ReportOutcomeResponse()

    async def ReportOutcomes(
        self, request: router_pb2.ReportOutcomesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReportOutcomeResponse:
        for o in request.outcomes:
            if o.worker_id:
                self.app.table.finish(o.worker_id, None, o.success, o.error_code)
        return router_pb2.ReportOutcomeResponse()

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

    async def GetStats(
        self, request: router_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetStatsResponse:
        table = self.app.table
        return router_pb2.GetStatsResponse(counters=table.counters, breakers=table.breakers())


def _header(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return str(v)
    return ""


def _unary_proxy(method: str) -> Callable[..., Awaitable[Any]]:
    """The WorkerService method ``method`` of the proxy: the call forwarded to a picked
    worker (``ProxyServicer._unary``)."""

    async def forward(self: ProxyServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(method, request, context)

    forward.__name__ = method
    forward.__qualname__ = f"ProxyServicer.{method}"
    return forward


class ProxyServicer(AppServicer["RouterApp"], worker_pb2_grpc.WorkerServiceServicer):
    """The worker API, forwarded to a worker the router picks."""

    def __init__(self, app: RouterApp) -> None:
        super().__init__(app)
        # The caller's request id (scoped to its tenant) → worker address, for Abort.
        self._requests: dict[str, str] = {}

    async def _target(
        self, method: str, context: grpc.aio.ServicerContext, exclude: tuple[str, ...], session: str
    ) -> PickResult:
        role = _header(context, "x-omniflow-role") or METHOD_ROLE.get(method, "")
        if not role:
            raise InvalidArgument(f"{method} through the router needs the x-omniflow-role header")
        strategy = _header(context, "x-omniflow-strategy")
        value = strategy_value(strategy) if strategy else 0
        return await self.app.pick(role, value, exclude=exclude, session_key=session)

    def _retryable(self, method: str, context: grpc.aio.ServicerContext) -> bool:
        return method in IDEMPOTENT or _header(context, "x-omniflow-idempotent") == "1"

    def _timeout(self) -> float:
        left = remaining_s()
        return self.app.settings.proxy_timeout_s if left is None else max(left, 0.0)

    def _failed(
        self,
        exc: OmniflowError,
        wid: str,
        ticket: int,
        first: bool,
        method: str,
        context: grpc.aio.ServicerContext,
    ) -> bool:
        """Record a proxied call's failure on ``wid``; True when it is tried once more on
        another worker: the first try (nothing streamed yet) of a retryable call failed with
        UNAVAILABLE."""
        self.app.table.finish(wid, ticket, False, exc.code_name)
        if first and isinstance(exc, Unavailable) and self._retryable(method, context):
            self.app.table.count("proxy_retries")
            return True
        return False

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        exclude: tuple[str, ...] = ()
        for attempt in (1, 2):
            pick = await self._target(method, context, exclude, "")
            wid = pick.worker.worker_id
            ticket = self.app.table.begin(wid)
            stub = worker_pb2_grpc.WorkerServiceStub(self.app.channel(pick.worker.address))
            try:
                reply = await getattr(stub, method)(request, timeout=self._timeout())
            except OmniflowError as exc:
                if self._failed(exc, wid, ticket, attempt == 1, method, context):
                    exclude = (wid,)
                    continue
                raise
            self.app.table.finish(wid, ticket, True)
            return reply
        raise AssertionError("unreachable")

    async def _stream(
        self, method: str, request: Any, context: grpc.aio.ServicerContext, session: str = ""
    ) -> AsyncIterator[Any]:
        exclude: tuple[str, ...] = ()
        for attempt in (1, 2):
            pick = await self._target(method, context, exclude, session)
            wid = pick.worker.worker_id
            ticket = self.app.table.begin(wid)
            stub = worker_pb2_grpc.WorkerServiceStub(self.app.channel(pick.worker.address))
            rid = getattr(request, "request_id", "")
            if rid:
                rid = scoped_id(rid)
                self._requests[rid] = pick.worker.address
            sent = False
            try:
                async for item in getattr(stub, method)(request, timeout=self._timeout()):
                    sent = True
                    yield item
            except OmniflowError as exc:
                if self._failed(exc, wid, ticket, attempt == 1 and not sent, method, context):
                    exclude = (wid,)
                    continue
                raise
            finally:
                self._requests.pop(rid, None)
            self.app.table.finish(wid, ticket, True)
            return

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        async for item in self._stream("Generate", request, context, request.session_key):
            yield item

    async def Synthesize(
        self, request: worker_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SynthesizeResponse]:
        async for item in self._stream("Synthesize", request, context):
            yield item

    # The unary methods, each forwarded to a picked worker by _unary.
    Encode = _unary_proxy("Encode")
    GenerateImage = _unary_proxy("GenerateImage")
    Invoke = _unary_proxy("Invoke")
    GetInfo = _unary_proxy("GetInfo")
    GetLoad = _unary_proxy("GetLoad")
    LoadModel = _unary_proxy("LoadModel")

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        address = self._requests.get(scoped_id(request.request_id))
        if address is None:
            return worker_pb2.AbortResponse(found=False)
        stub = worker_pb2_grpc.WorkerServiceStub(self.app.channel(address))
        return await stub.Abort(request, timeout=self._timeout())


class RouterApp(ServiceApp):
    """Watches workers in discovery, polls their load; answers Pick and proxies calls (the
    pick policy is the library's ``omniflow.routing.picker.Picker``)."""

    name = "router"

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.picker = Picker(settings)
        self.table = self.picker.table
        self.runtime: Runtime | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: dict[str, TracedChannel] = {}
        self._unwatch = metrics.watch(self.table)

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(self), server)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(ProxyServicer(self), server)
        return [
            router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
            worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
        ]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.picker.open_index(self._index_address)
        first = asyncio.get_running_loop().create_future()
        self._tasks.append(asyncio.create_task(self.picker.follow(runtime.registry, first)))
        # SERVING only once the first listing of workers is in.
        await asyncio.wait_for(first, timeout=self.settings.call_timeout_s)
        if self.settings.health_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.picker.poll_health(self._queue_of)))

    async def _index_address(self) -> str:
        assert self.runtime is not None
        return await find_address(
            self.runtime.registry,
            "kv-index",
            configured=self.settings.kv_index_addr,
            node=self.runtime.node,
        )

    async def pick(
        self, role: str, strategy_enum: int, **options: Unpack[PickOptions]
    ) -> PickResult:
        """One worker for a call (``Picker.pick``); ``strategy_enum`` 0: the role's default."""
        if not role:
            raise InvalidArgument("role is required (e.g. 'llm', 'encoder', 'diffusion')")
        started = time.perf_counter()
        strategy = strategy_name(strategy_enum, self.settings.strategy_for(role))
        result = await self.picker.pick(role, strategy, **options)
        metrics.picked(result, time.perf_counter() - started)
        return result

    async def _queue_of(self, worker: WorkerRecord) -> int | None:
        load = await self.load_of(worker)
        return None if load is None else load.running_requests + load.waiting_requests

    def channel(self, address: str) -> TracedChannel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(
                address, default_timeout_s=self.settings.proxy_timeout_s, max_in_flight=None
            )
            self._channels[address] = channel
        return channel

    async def load_of(self, worker: WorkerRecord) -> common_pb2.WorkerLoad | None:
        """A worker's load, or None when it does not answer within the load deadline."""
        stub = worker_pb2_grpc.WorkerServiceStub(self.channel(worker.address))
        started = time.perf_counter()
        try:
            reply = await stub.GetLoad(
                worker_pb2.GetLoadRequest(), timeout=self.settings.load_timeout_s
            )
        except OmniflowError as exc:
            log.debug(
                "GetLoad of %s failed after %.1f ms: %s",
                worker.worker_id,
                (time.perf_counter() - started) * 1e3,
                exc.code_name,
            )
            return None
        return reply.load

    async def stop(self) -> None:
        self._unwatch()
        for task in self._tasks:
            await stop_task(task)
        await self.picker.close()
        for channel in self._channels.values():
            await channel.close()
