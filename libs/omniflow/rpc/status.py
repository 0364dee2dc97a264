"""The one table that maps domain errors to gRPC status codes, and back for clients."""

from __future__ import annotations

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
}


def status_of(exc: errors.OmniflowError) -> grpc.StatusCode:
    """The gRPC status code of a domain error."""
    return grpc.StatusCode[exc.code_name]


# Failures of a dependency that say "not now", not "a bug": Redis refusing connections,
# timing out or still loading its AOF (BusyLoadingError is a ConnectionError).
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis_exc.ConnectionError,
    redis_exc.TimeoutError,
)


def domain_error(exc: BaseException) -> errors.OmniflowError | None:
    """``exc`` as a domain error: itself, an infrastructure failure mapped once here
    (Redis down → Unavailable), or None for anything else (a bug → INTERNAL)."""
    if isinstance(exc, errors.OmniflowError):
        return exc
    if isinstance(exc, _UNAVAILABLE_ERRORS):
        return errors.Unavailable(f"Redis does not answer ({type(exc).__name__}: {exc}); retry")
    return None


def error_from_rpc(exc: grpc.aio.AioRpcError | grpc.RpcError) -> errors.OmniflowError:
    """The domain error for a failed call, so that cores never see gRPC types."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, errors.OmniflowError)
    return cls(details or code.name)


def unimplemented(capability: str) -> errors.Unimplemented:
    """The error for an RPC whose capability has not been built into this service yet."""
    return errors.Unimplemented(f"not available yet: needs {capability}")
