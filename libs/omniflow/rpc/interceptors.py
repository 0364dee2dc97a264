"""Server and client interceptors: tracing, metrics, error mapping, deadlines, bounds.

One interceptor per side keeps the per-call overhead to a few microseconds: the server
side opens a SERVER span under the caller's ``traceparent``, records the deadline of
the call in a context variable, maps domain errors to status codes and counts the
result; the client side opens a CLIENT span, injects ``traceparent``, bounds the calls
in flight, and gives every call a deadline — the caller's own, or what is left of the
handler's deadline when it is made from inside a handler, whichever is sooner.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omniflow import errors, telemetry
from omniflow.config import TelemetrySettings, load_settings
from omniflow.rpc.status import domain_error, error_from_rpc, status_of
from omniflow.security import policy
from omniflow.security.identity import Identity
from omniflow.security.transport import Security

log = logging.getLogger(__name__)

# Absolute time.monotonic() deadline of the RPC being served in this context, if any.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "omniflow_deadline", default=None
)


def remaining_s() -> float | None:
    """Seconds left of the deadline of the RPC being served, or None outside a handler."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


class _MetadataGetter:
    def get(self, carrier: tuple[tuple[str, Any], ...], key: str) -> list[str] | None:
        found = [v for k, v in carrier if k == key]
        return found or None

    def keys(self, carrier: tuple[tuple[str, Any], ...]) -> list[str]:
        return [k for k, _ in carrier]


_GETTER = _MetadataGetter()
_tracer = telemetry.tracer


class ServingGate:
    """Whether a server's methods serve yet. The bootstrap binds and serves health before
    the app has started (a model loading), and closes this gate meanwhile: every call is
    refused with UNAVAILABLE, which callers fail over on, instead of reaching an app that
    is not ready (the health service is not behind it: it says NOT_SERVING)."""

    __slots__ = ("name", "open")

    def __init__(self, name: str = "", open: bool = True) -> None:
        self.name, self.open = name, open

    def refusal(self, short: str) -> errors.Unavailable:
        who = self.name or "this service"
        return errors.Unavailable(f"{short}: {who} is not SERVING (starting or stopping); retry")


class WrappingServer:
    """What a service's ``add_*Servicer_to_server`` sees instead of the real server.

    Each method handler is wrapped once, at registration, with tracing, metrics, the
    deadline context and the error table. Measured here, this costs a third of what a
    ``grpc.aio.ServerInterceptor`` does per call (no extra coroutine hop per RPC).
    With a ``gate``, calls are refused (UNAVAILABLE) while it is closed.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        security: Security | None = None,
        gate: ServingGate | None = None,
    ) -> None:
        self._server = server
        self._gate = gate
        self._pending: list[grpc.GenericRpcHandler] = []
        # With auth off the handlers are wrapped without any check (no cost per call).
        self._security = security if security is not None and security.auth_on else None

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        # Generated code follows this with add_registered_method_handlers for the same
        # service, where the handlers arrive as a dict that can be wrapped.
        self._pending.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        sec = self._security
        wrapped = {
            name: _wrap_handler(h, f"/{service}/{name}", sec, self._gate)
            for name, h in handlers.items()
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, wrapped),)
        )
        self._server.add_registered_method_handlers(service, wrapped)
        self._pending = [h for h in self._pending if _service_of(h) != service]

    def finish(self) -> None:
        """Pass through handlers that never came as a dict (hand-written generic ones)."""
        if self._pending and self._security is not None:
            # Fail closed: a handler the policy cannot wrap would serve unchecked.
            raise RuntimeError(
                f"{len(self._pending)} generic handler(s) cannot be checked by the policy "
                "with OMNIFLOW_AUTH=on; register servicers through add_*Servicer_to_server"
            )
        if self._pending:
            self._server.add_generic_rpc_handlers(tuple(self._pending))
            self._pending = []


def _service_of(handler: Any) -> str | None:
    name = getattr(handler, "service_name", None)
    return name() if callable(name) else None


class _Guard:
    """The policy check of one method: who calls (certificate, token) and may they."""

    __slots__ = ("method", "own", "rule", "security")

    def __init__(self, security: Security, method: str) -> None:
        self.security, self.method = security, method
        self.rule = policy.rule_for(method)
        self.own: Identity | None = security.identity

    def check(self, context: grpc.aio.ServicerContext, metadata: Any = None) -> None:
        # Each RPC runs in a task of its own: the caller set here is that RPC's alone.
        who = self.security.principal(context, metadata)
        if not self.rule.allows(who, self.own):
            raise errors.PermissionDenied(
                f"{self.method}: {who.describe()} may not call this method (docs/security.md)"
            )
        policy.set_current(who)


def _wrap_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    security: Security | None = None,
    gate: ServingGate | None = None,
) -> grpc.RpcMethodHandler:
    short = method.rsplit("/", 1)[-1]
    parse = _tolerant(handler.request_deserializer)
    guard = _Guard(security, method) if security is not None else None
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            _wrap(handler.unary_unary, method, short, False, guard, gate),
            parse,
            handler.response_serializer,
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _wrap(handler.stream_unary, method, short, True, guard, gate),
            parse,
            handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _wrap(handler.unary_stream, method, short, False, guard, gate),
            parse,
            handler.response_serializer,
        )
    return grpc.stream_stream_rpc_method_handler(
        _wrap(handler.stream_stream, method, short, True, guard, gate),
        parse,
        handler.response_serializer,
    )


class _Undecodable:
    """What a request that does not parse becomes: the handler answers INVALID_ARGUMENT
    (gRPC itself would answer INTERNAL and log a traceback per message)."""

    __slots__ = ("error", "size")

    def __init__(self, error: Exception, size: int) -> None:
        self.error, self.size = error, size


def _tolerant(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def tolerant(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # any parse failure is the sender's
            return _Undecodable(exc, len(data))

    return tolerant


#: client host -> monotonic time its last undecodable message was logged
_LOGGED_BAD: dict[str, float] = {}
BAD_MESSAGE_LOG_INTERVAL_S = 60.0


def _undecodable(context: grpc.aio.ServicerContext, bad: _Undecodable, short: str) -> Exception:
    """The INVALID_ARGUMENT for an undecodable request; logged once per client per minute."""
    peer = context.peer() or "unknown"
    host = peer.rsplit(":", 1)[0]  # "ipv4:127.0.0.1:52114" -> one entry per host, not port
    now = time.monotonic()
    if now - _LOGGED_BAD.get(host, -BAD_MESSAGE_LOG_INTERVAL_S) >= BAD_MESSAGE_LOG_INTERVAL_S:
        if len(_LOGGED_BAD) > 4096:
            _LOGGED_BAD.clear()  # bounded: a flood of hosts costs a log line each at most
        _LOGGED_BAD[host] = now
        log.warning(
            "%s: undecodable request of %d bytes from %s (%s); further ones from this "
            "client are not logged for %.0f s",
            short, bad.size, peer, bad.error, BAD_MESSAGE_LOG_INTERVAL_S,
        )  # fmt: skip
    return errors.InvalidArgument(
        f"{short}: the request ({bad.size} bytes) is not a valid protobuf message of this "
        "method's request type"
    )


async def _checked(requests: AsyncIterator[Any], context: Any, short: str) -> AsyncIterator[Any]:
    async for item in requests:
        if type(item) is _Undecodable:
            raise _undecodable(context, item, short)
        yield item


def _propagator() -> Any:
    """W3C trace context, unless OTEL_PROPAGATORS asks for the configured global set.

    Calling the trace-context propagator directly skips the baggage pass of the default
    composite: half the cost of extract/inject on every call.
    """
    if load_settings(TelemetrySettings).propagators:
        return propagate.get_global_textmap()
    return TraceContextTextMapPropagator()


_PROPAGATOR = _propagator()


class _MethodStats:
    """Prometheus children of one method, looked up once instead of on every call."""

    __slots__ = ("by_code", "method", "seconds")

    def __init__(self, method: str) -> None:
        self.method = method
        self.seconds = telemetry.RPC_SECONDS.labels(method)
        self.by_code: dict[str, Any] = {}

    def count(self, context: grpc.aio.ServicerContext, started: float) -> None:
        code = context.code()
        name = code.name if isinstance(code, grpc.StatusCode) else "OK"
        counter = self.by_code.get(name)
        if counter is None:
            counter = self.by_code[name] = telemetry.RPC_SERVED.labels(self.method, name)
        counter.inc()
        self.seconds.observe(time.perf_counter() - started)


def _enter(
    context: grpc.aio.ServicerContext, method: str, metadata: Any
) -> tuple[trace.Span, object, object]:
    parent = _PROPAGATOR.extract(metadata, getter=_GETTER)
    span = _tracer().start_span(method, context=parent, kind=SpanKind.SERVER)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    left = context.time_remaining()
    dl_token = _DEADLINE.set(None if left is None else time.monotonic() + left)
    return span, token, dl_token


def _leave(span: trace.Span, token: object, dl_token: object) -> None:
    span.end()
    # A stream may be closed from another context (client gone): then there is nothing
    # of ours to restore in the current one.
    try:
        _DEADLINE.reset(dl_token)  # type: ignore[arg-type]
        otel_context.detach(token)  # type: ignore[arg-type]
    except ValueError:
        pass


async def _fail(
    context: grpc.aio.ServicerContext, span: trace.Span, exc: BaseException, short: str
) -> None:
    """Abort the RPC with the status of ``exc`` (the error table), recording it on the span."""
    mapped = domain_error(exc)
    if mapped is not None:
        code, message = status_of(mapped), str(mapped)
    else:
        log.exception("%s failed", short)
        code, message = grpc.StatusCode.INTERNAL, f"internal error in {short}: {exc!r}"
    span.set_status(Status(StatusCode.ERROR, message))
    await context.abort(code, message)


class _Served:
    """One call a handler serves, unary or streaming alike: its span, trace context and
    deadline entered; any error (not a cancel, not an abort already made) turned into the
    call's status by ``_fail``; left and counted when it ends, however it ends."""

    __slots__ = ("context", "dl_token", "metadata", "short", "span", "started", "stats", "token")

    def __init__(
        self, context: grpc.aio.ServicerContext, method: str, short: str, stats: _MethodStats
    ) -> None:
        self.started = time.perf_counter()
        self.context, self.short, self.stats = context, short, stats
        self.metadata = context.invocation_metadata() or ()
        self.span, self.token, self.dl_token = _enter(context, method, self.metadata)

    async def __aenter__(self) -> _Served:
        return self

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            # CancelledError is no Exception; an AbortError is the status already made.
            if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
                await _fail(self.context, self.span, exc, self.short)  # raises the abort
                return True
        finally:
            _leave(self.span, self.token, self.dl_token)
            self.stats.count(self.context, self.started)
        return False


def _admitted(
    request: Any,
    context: grpc.aio.ServicerContext,
    metadata: Any,
    short: str,
    streamed: bool,
    guard: _Guard | None,
    gate: ServingGate | None,
) -> Any:
    """The request a handler may serve, or the error that refuses it: the serving gate, the
    caller's policy, an undecodable request (a streamed one is checked item by item)."""
    if gate is not None and not gate.open:
        raise gate.refusal(short)
    if guard is not None:
        guard.check(context, metadata)
    if streamed:
        return _checked(request, context, short)
    if type(request) is _Undecodable:
        raise _undecodable(context, request, short)
    return request


def _wrap(
    behavior: Callable[..., Any],
    method: str,
    short: str,
    streamed: bool,
    guard: _Guard | None = None,
    gate: ServingGate | None = None,
) -> Callable[..., Any]:
    """``behavior`` served through ``_Served`` and ``_admitted``: an async generator (a
    streaming response) as an async generator; a coroutine (a unary response, or a stream
    written with ``context.write()``) as a coroutine."""
    stats = _MethodStats(method)

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with _Served(context, method, short, stats) as call:
                request = _admitted(request, context, call.metadata, short, streamed, guard, gate)
                async for item in behavior(request, context):
                    yield item

        return stream

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _Served(context, method, short, stats) as call:
            request = _admitted(request, context, call.metadata, short, streamed, guard, gate)
            return await behavior(request, context)

    return handle


class TracedChannel:
    """A grpc.aio channel whose calls get a deadline, a CLIENT span with ``traceparent``,
    and a bound on calls in flight. A failed call raises the domain error of its status
    (``omniflow.rpc.status.error_from_rpc``; it is also a ``grpc.aio.AioRpcError``).

    Generated stubs take it like a channel. The wrapping happens here rather than in a
    ``grpc.aio`` client interceptor because that machinery adds a task per call; this
    costs a fraction. Unary-response calls return an awaitable of the response;
    streaming-response calls return an async iterator (with ``cancel()``).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        default_timeout_s: float,
        max_in_flight: int | None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._channel = channel
        self.default_timeout_s = default_timeout_s
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        #: Sent with every call before the caller's own (the process's token).
        self.metadata = metadata

    # -- what stubs call
    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Unary(self, method, self._channel.unary_unary(method, *args, **kwargs))

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Unary(self, method, self._channel.stream_unary(method, *args, **kwargs))

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Streaming(self, method, self._channel.unary_stream(method, *args, **kwargs))

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Streaming(self, method, self._channel.stream_stream(method, *args, **kwargs))

    # -- the rest of the channel API
    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def __aenter__(self) -> TracedChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close(None)

    # -- per call
    def call_options(
        self, method: str, timeout: float | None, metadata: Any
    ) -> tuple[trace.Span, float, tuple[tuple[str, Any], ...]]:
        span = _tracer().start_span(method, kind=SpanKind.CLIENT)
        timeout = self.default_timeout_s if timeout is None else timeout
        left = remaining_s()
        if left is not None:
            timeout = min(timeout, max(left, 0.0))
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        # The tenant of the call being served travels on (security.policy), before the
        # caller's own metadata (which may name one itself).
        forward = policy.forwarding_metadata()
        return span, timeout, (*self.metadata, *forward, *tuple(metadata or ()), *carrier.items())

    async def acquire(self) -> None:
        if self._slots is not None:
            await self._slots.acquire()

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()


def _record_error(span: trace.Span, exc: grpc.aio.AioRpcError) -> None:
    span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))


class _Unary:
    """A unary-response method of a TracedChannel."""

    __slots__ = ("_channel", "_inner", "_method")

    def __init__(self, channel: TracedChannel, method: str, inner: Any) -> None:
        self._channel, self._method, self._inner = channel, method, inner

    async def __call__(
        self, request: Any, *, timeout: float | None = None, metadata: Any = None, **kw: Any
    ) -> Any:
        span, timeout, md = self._channel.call_options(self._method, timeout, metadata)
        await self._channel.acquire()
        try:
            return await self._inner(request, timeout=timeout, metadata=md, **kw)
        except grpc.aio.AioRpcError as exc:
            _record_error(span, exc)
            raise error_from_rpc(exc) from None
        finally:
            span.end()
            self._channel.release()


class _Streaming:
    """A streaming-response method of a TracedChannel."""

    __slots__ = ("_channel", "_inner", "_method")

    def __init__(self, channel: TracedChannel, method: str, inner: Any) -> None:
        self._channel, self._method, self._inner = channel, method, inner

    def __call__(
        self, request: Any = None, *, timeout: float | None = None, metadata: Any = None, **kw: Any
    ) -> StreamCall:
        return StreamCall(self._channel, self._method, self._inner, request, timeout, metadata, kw)


class StreamCall:
    """A streaming-response call: iterate it for the responses; ``cancel()`` ends it."""

    def __init__(
        self,
        channel: TracedChannel,
        method: str,
        inner: Any,
        request: Any,
        timeout: float | None,
        metadata: Any,
        kw: dict[str, Any],
    ) -> None:
        self._channel = channel
        self._args = (method, inner, request, timeout, metadata, kw)
        self.call: Any = None  # the grpc.aio call, once started
        self._cancelled = False

    def cancel(self) -> bool:
        self._cancelled = True
        return self.call.cancel() if self.call is not None else True

    async def code(self) -> grpc.StatusCode:
        return await self.call.code()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        method, inner, request, timeout, metadata, kw = self._args
        span, timeout, md = self._channel.call_options(method, timeout, metadata)
        await self._channel.acquire()
        try:
            if self._cancelled:
                return
            self.call = inner(request, timeout=timeout, metadata=md, **kw)
            async for item in self.call:
                yield item
        except grpc.aio.AioRpcError as exc:
            _record_error(span, exc)
            raise error_from_rpc(exc) from None
        finally:
            if self.call is not None and not self.call.done():
                self.call.cancel()  # the consumer stopped early
            span.end()
            self._channel.release()
