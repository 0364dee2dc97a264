"""The base of every service's servicers: a servicer holds its service's app.

The gRPC edge is thin (a servicer converts protobuf and calls the app, which owns the
state and the clients), so every servicer is built from the one ``ServiceApp`` it serves::

    class RouterServicer(AppServicer["RouterApp"], router_pb2_grpc.RouterServiceServicer):
        async def Pick(self, request, context): ... self.app.pick(...) ...
"""

from __future__ import annotations

from typing import Generic, TypeVar

from omniflow.rpc.server import ServiceApp

A = TypeVar("A", bound=ServiceApp)


class AppServicer(Generic[A]):
    """A servicer bound to ``app``, the service it answers for (``self.app``)."""

    def __init__(self, app: A) -> None:
        self.app = app
