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

from omniflow import errors, telemetry
from omniflow.rpc.status import status_of

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


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Tracing, metrics, deadline context and the error table, for every servicer."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _wrap_handler(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    short = method.rsplit("/", 1)[-1]
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary(handler.unary_unary, method, short),
            handler.request_deserializer,
            handler.response_serializer,
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _wrap_unary(handler.stream_unary, method, short),
            handler.request_deserializer,
            handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _wrap_stream(handler.unary_stream, method, short),
            handler.request_deserializer,
            handler.response_serializer,
        )
    return grpc.stream_stream_rpc_method_handler(
        _wrap_stream(handler.stream_stream, method, short),
        handler.request_deserializer,
        handler.response_serializer,
    )


def _enter(context: grpc.aio.ServicerContext, method: str) -> tuple[trace.Span, object, object]:
    parent = propagate.extract(context.invocation_metadata() or (), getter=_GETTER)
    span = telemetry.tracer().start_span(method, context=parent, kind=SpanKind.SERVER)
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
    if isinstance(exc, errors.OmniflowError):
        code, message = status_of(exc), str(exc)
    else:
        log.exception("%s failed", short)
        code, message = grpc.StatusCode.INTERNAL, f"internal error in {short}: {exc!r}"
    span.set_status(Status(StatusCode.ERROR, message))
    await context.abort(code, message)


def _count(method: str, context: grpc.aio.ServicerContext, started: float) -> None:
    code = context.code()
    name = code.name if isinstance(code, grpc.StatusCode) else "OK"
    telemetry.RPC_SERVED.labels(method, name).inc()
    telemetry.RPC_SECONDS.labels(method).observe(time.perf_counter() - started)


def _wrap_unary(behavior: Callable[..., Any], method: str, short: str) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        span, token, dl_token = _enter(context, method)
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # every error becomes a status
            await _fail(context, span, exc, short)
        finally:
            _leave(span, token, dl_token)
            _count(method, context, started)

    return handle


def _wrap_stream(behavior: Callable[..., Any], method: str, short: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # A handler that writes with context.write() is a plain coroutine.
        return _wrap_unary(behavior, method, short)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started = time.perf_counter()
        span, token, dl_token = _enter(context, method)
        try:
            async for item in behavior(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _fail(context, span, exc, short)
        finally:
            _leave(span, token, dl_token)
            _count(method, context, started)

    return handle


class ClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Deadline on every call, bounded calls in flight, and a CLIENT span per call."""

    def __init__(self, default_timeout_s: float, max_in_flight: int | None = None) -> None:
        self._default_timeout_s = default_timeout_s
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None

    def _details(
        self, details: grpc.aio.ClientCallDetails, span: trace.Span
    ) -> grpc.aio.ClientCallDetails:
        timeout = details.timeout if details.timeout is not None else self._default_timeout_s
        left = remaining_s()
        if left is not None:
            timeout = min(timeout, max(left, 0.0))
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        for key, value in carrier.items():
            metadata.add(key, value)
        return details._replace(timeout=timeout, metadata=metadata)

    def _start(self, details: grpc.aio.ClientCallDetails) -> trace.Span:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        return telemetry.tracer().start_span(method, kind=SpanKind.CLIENT)

    async def _unary_response(self, continuation: Any, details: Any, request: Any) -> Any:
        span = self._start(details)
        if self._slots is not None:
            await self._slots.acquire()
        try:
            call = await continuation(self._details(details, span), request)
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
            return call
        finally:
            span.end()
            if self._slots is not None:
                self._slots.release()

    async def _stream_response(self, continuation: Any, details: Any, request: Any) -> Any:
        span = self._start(details)
        if self._slots is not None:
            await self._slots.acquire()
        try:
            call = await continuation(self._details(details, span), request)
        except BaseException:
            span.end()
            if self._slots is not None:
                self._slots.release()
            raise

        def done(_call: Any) -> None:
            span.end()
            if self._slots is not None:
                self._slots.release()

        call.add_done_callback(done)
        return call

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._unary_response(continuation, details, request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._unary_response(continuation, details, request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._stream_response(continuation, details, request)

    async def intercept_stream_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._stream_response(continuation, details, request)
