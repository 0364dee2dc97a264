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
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.convert import strategy_name, strategy_value, worker_info
from omniflow.discovery import find_address
from omniflow.errors import InvalidArgument, OmniflowError, Unavailable
from omniflow.kv.index_store import OwnerMatch
from omniflow.kv.wire import read_namespace
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel, remaining_s
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.security.tenancy import scoped_id
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance
from omniflow_services.router import metrics
from omniflow_services.router.config import RouterSettings
from omniflow_services.router.core import PickResult, WorkerTable
from omniflow_services.router.kvmatch import GrpcPrefixIndex, PrefixIndex, RedisPrefixIndex

log = logging.getLogger(__name__)

# Role a proxied method goes to when the caller names none.
METHOD_ROLE = {
    "Generate": "llm",
    "Encode": "encoder",
    "GenerateImage": "diffusion",
    "Synthesize": "talker",
}
IDEMPOTENT = frozenset({"Generate", "Encode", "GenerateImage", "Synthesize", "GetInfo", "GetLoad"})


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, app: RouterApp) -> None:
        self.app = app

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


def _acknowledged(node: str, blocks: int) -> OwnerMatch:
    """The agent of ``node`` as holding all ``blocks`` in its host tier: the caller knows it
    acknowledged storing them (a prefill_only reply), though the index may not say so yet."""
    return OwnerMatch(f"acknowledged@{node}", node, "", "agent", blocks, (0, blocks, 0))


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


class ProxyServicer(worker_pb2_grpc.WorkerServiceServicer):
    """The worker API, forwarded to a worker the router picks."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app
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
    """Watches workers in discovery, polls their load; answers Pick and proxies calls."""

    name = "router"

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.table = WorkerTable(
            breaker_threshold=settings.breaker_threshold,
            breaker_cooldown_s=settings.breaker_cooldown_s,
            link_gbps=settings.link_gbps,
            prefill_tokens_s=settings.prefill_tokens_s,
        )
        self.runtime: Runtime | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: dict[str, TracedChannel] = {}
        self.index: PrefixIndex | None = None
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
        way = self.settings.kv_index
        if way == "auto":  # the index's own Redis when this router has it: one round trip
            way = "redis" if self.settings.redis_url else "grpc"
        if way == "grpc":
            self.index = GrpcPrefixIndex(self._index_address)
        elif way == "redis":
            s = self.settings
            self.index = RedisPrefixIndex(s.redis_url, s.kv_index_timeout_s, s.kv_key_prefix)
        first = asyncio.get_running_loop().create_future()
        self._tasks.append(asyncio.create_task(self._follow(runtime, first)))
        # SERVING only once the first listing of workers is in.
        await asyncio.wait_for(first, timeout=self.settings.call_timeout_s)
        if self.settings.health_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._poll_health()))

    async def _index_address(self) -> str:
        assert self.runtime is not None
        return await find_address(
            self.runtime.registry,
            "kv-index",
            configured=self.settings.kv_index_addr,
            node=self.runtime.node,
        )

    async def pick(
        self,
        role: str,
        strategy_enum: int,
        *,
        exclude: tuple[str, ...] = (),
        operation: str = "",
        session_key: str = "",
        namespace: bytes = b"",
        hashes: list[bytes] | None = None,
        temperature: float = 0.0,
        stored_node: str = "",
    ) -> PickResult:
        """One worker for a call; for kv_aware, ``stored_node`` names a node whose agent
        already acknowledged every block of ``hashes`` (counted before the index knows)."""
        if not role:
            raise InvalidArgument("role is required (e.g. 'llm', 'encoder', 'diffusion')")
        started = time.perf_counter()
        strategy = strategy_name(strategy_enum, self.settings.strategy_for(role))
        reach, fallback = None, ""
        if strategy == "kv_aware":
            reach, fallback = await self._match(namespace, hashes or [])
            if stored_node and hashes:
                reach = [*(reach or []), _acknowledged(stored_node, len(hashes))]
        result = self.table.pick(
            role,
            strategy,
            exclude,
            operation,
            session_key=session_key,
            reach=reach,
            prompt_blocks=len(hashes or []),
            temperature=temperature or self.settings.kv_temperature,
            load_weight=self.settings.kv_load_weight,
            fallback_reason=fallback,
        )
        metrics.picked(result, time.perf_counter() - started)
        return result

    async def _match(self, namespace: bytes, hashes: list[bytes]) -> tuple[Any, str]:
        if not hashes:
            return [], ""
        if self.index is None:
            self.table.count("kv_fallback_off")
            return None, "kv index is off: load only"
        try:
            # asyncio.timeout, not wait_for: no task made and scheduled for every pick.
            async with asyncio.timeout(self.settings.kv_index_timeout_s):
                reach = await self.index.match(namespace, hashes)
        except TimeoutError:
            self.table.count("kv_fallback_timeout")
            return None, "kv index timed out: load only"
        except OmniflowError as exc:
            self.table.count("kv_fallback_error")
            return None, f"kv index failed ({exc.code_name}): load only"
        return reach, ""

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

    async def _poll_health(self) -> None:
        while True:
            workers = self.table.list()
            loads = await asyncio.gather(*(self.load_of(w) for w in workers))
            for w, load in zip(workers, loads, strict=True):
                queue = 0 if load is None else load.running_requests + load.waiting_requests
                self.table.set_health(w.worker_id, load is not None, queue)
            await asyncio.sleep(self.settings.health_interval_s)

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
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.index is not None:
            await self.index.close()
        for channel in self._channels.values():
            await channel.close()
