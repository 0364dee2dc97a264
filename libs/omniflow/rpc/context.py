"""Naming the call that failed: one way to put context on an error from a gRPC call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import grpc

from omniflow.rpc.status import error_from_rpc


@contextlib.contextmanager
def failed_call(what: str, on_error: Callable[[], None] | None = None) -> Iterator[None]:
    """An error from a gRPC call inside leaves as its domain error (``omniflow.errors``, its
    class kept) with ``what: `` before its message; ``on_error`` runs first (a counter).

    Works for unary calls and around ``async for`` over a stream alike."""
    try:
        yield
    except grpc.RpcError as exc:  # grpc.aio.AioRpcError, and the channel's domain errors
        if on_error is not None:
            on_error()
        err = error_from_rpc(exc)
        err.args = (f"{what}: {err}",)
        raise err from None
