"""The one table that maps domain errors to gRPC status codes, and back for clients.

Servers: an escaping domain error becomes its status (``status_of``). Clients: every call
through :class:`omniflow.rpc.interceptors.TracedChannel` that fails raises the domain error
of its status (``error_from_rpc``), so callers catch ``omniflow.errors`` and never re-wrap.
"""

from __future__ import annotations

from typing import Any

import grpc
import redis.exceptions as redis_exc

from omniflow import errors

_BY_CODE: dict[grpc.StatusCode, type[errors.OmniflowError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unimplemented,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}


def _remote(base: type[errors.OmniflowError], code: grpc.StatusCode) -> type[errors.OmniflowError]:
    """``base`` as a failed call raises it: also a ``grpc.aio.AioRpcError`` (``code()``,
    ``details()``, metadata), so that code written against grpc's error keeps working.
    Its message is the status details, and ``type(err)("more context: ...")`` builds one
    like a local domain error (same code, that message)."""

    def __init__(
        self: Any,
        message: str = "",
        *,
        status: grpc.StatusCode = code,
        metadata: tuple[Any, Any, str | None] = (None, None, None),
    ) -> None:
        initial, trailing, debug = metadata
        grpc.aio.AioRpcError.__init__(self, status, initial, trailing, message, debug)
        self.args = (message,)

    return type(
        base.__name__,
        (base, grpc.aio.AioRpcError),
        {
            "__init__": __init__,
            "__module__": __name__,
            "__qualname__": base.__name__,
            "__str__": Exception.__str__,
        },
    )


# Built once: one class per code, so ``except errors.NotFound`` and ``type(exc)`` behave.
_REMOTE: dict[grpc.StatusCode, type[errors.OmniflowError]] = {
    code: _remote(cls, code) for code, cls in _BY_CODE.items()
}
_REMOTE_OTHER = _remote(errors.OmniflowError, grpc.StatusCode.UNKNOWN)  # INTERNAL, ABORTED...


def status_of(exc: errors.OmniflowError) -> grpc.StatusCode:
    """The gRPC status code of a domain error."""
    return grpc.StatusCode[exc.code_name]


# Failures of a dependency that say "not now", not "a bug": Redis refusing connections,
# timing out or still loading its AOF (BusyLoadingError is a ConnectionError), or a
# replica that takes no writes (READONLY: a failover in progress).
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis_exc.ConnectionError,
    redis_exc.TimeoutError,
    redis_exc.ReadOnlyError,
)
# Redis error replies that mean "this server cannot take writes now", not a bad command:
# MISCONF (its last RDB/AOF write failed, e.g. a full disk), MASTERDOWN (a replica cut off
# from its primary), NOREPLICAS (fewer replicas than min-replicas-to-write).
_UNAVAILABLE_REPLIES = ("MISCONF", "MASTERDOWN", "NOREPLICAS", "READONLY")


def domain_error(exc: BaseException) -> errors.OmniflowError | None:
    """``exc`` as a domain error: itself, an infrastructure failure mapped once here
    (Redis down → Unavailable), or None for anything else (a bug → INTERNAL)."""
    if isinstance(exc, errors.OmniflowError):
        return exc
    if isinstance(exc, NotImplementedError):  # a generated servicer's method not written
        return errors.Unimplemented(f"this method is not implemented here ({exc})")
    if isinstance(exc, _UNAVAILABLE_ERRORS):
        return errors.Unavailable(f"Redis does not answer ({type(exc).__name__}: {exc}); retry")
    if isinstance(exc, redis_exc.ResponseError) and str(exc).startswith(_UNAVAILABLE_REPLIES):
        return errors.Unavailable(f"Redis refuses writes now ({exc}); retry")
    return None


def error_from_rpc(exc: grpc.aio.AioRpcError | grpc.RpcError) -> errors.OmniflowError:
    """The domain error for a failed call (the table above, read backwards), so that cores
    never see gRPC types. One already mapped is returned as is."""
    if isinstance(exc, errors.OmniflowError):
        return exc
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    metadata = (
        _call_value(exc, "initial_metadata"),
        _call_value(exc, "trailing_metadata"),
        _call_value(exc, "debug_error_string"),
    )
    cls = _REMOTE.get(code, _REMOTE_OTHER)
    return cls(details or code.name, status=code, metadata=metadata)  # type: ignore[call-arg]


def _call_value(exc: BaseException, name: str) -> Any:
    getter = getattr(exc, name, None)
    return getter() if callable(getter) else None


def unimplemented(capability: str) -> errors.Unimplemented:
    """The error for an RPC whose capability has not been built into this service yet."""
    return errors.Unimplemented(f"not available yet: needs {capability}")
