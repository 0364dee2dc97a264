"""A failed call through the library's channel raises the domain error of its status, once,
for unary and streaming calls alike; it still answers grpc's ``code()``/``details()``."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omniflow import errors
from omniflow.rpc.client import open_channel
from omniflow.rpc.status import error_from_rpc


@pytest.fixture
async def health_address() -> AsyncIterator[str]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("known", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_unary_failure_is_the_domain_error(health_address: str) -> None:
    async with open_channel(health_address, default_timeout_s=5.0) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        ok = await stub.Check(health_pb2.HealthCheckRequest(service="known"))
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(errors.NotFound) as caught:
            await stub.Check(health_pb2.HealthCheckRequest(service="unknown"))
    err = caught.value
    # grpc's view of the same failure, for code written against it.
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert str(err) == (err.details() or "NOT_FOUND")  # grpc's health sends no details
    assert err.code_name == "NOT_FOUND"
    assert error_from_rpc(err) is err  # mapped once, never again
    # Re-raised with more context, as a local domain error would be.
    again = type(err)(f"checking health: {err}")
    assert isinstance(again, errors.NotFound) and again.code() == grpc.StatusCode.NOT_FOUND
    assert str(again) == f"checking health: {err}"


async def test_unreachable_peer_is_unavailable_for_streams_too() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with open_channel(f"127.0.0.1:{port}", default_timeout_s=2.0) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(errors.Unavailable):
            await stub.Check(health_pb2.HealthCheckRequest())
        with pytest.raises(errors.Unavailable) as caught:
            async for _ in stub.Watch(health_pb2.HealthCheckRequest()):
                pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_code_in_the_table_maps_back_to_its_error() -> None:
    for cls in (
        errors.InvalidArgument,
        errors.NotFound,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.DeadlineExceeded,
        errors.PermissionDenied,
        errors.Unauthenticated,
    ):
        code = grpc.StatusCode[cls.code_name]
        err = error_from_rpc(grpc.aio.AioRpcError(code, None, None, "why", None))
        assert isinstance(err, cls) and err.code() == code and str(err) == "why"
    other = error_from_rpc(grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, None, None, "", None))
    assert type(other).__mro__[1] is errors.OmniflowError
    assert str(other) == "ABORTED" and other.code_name == "INTERNAL"
