"""The kv-index gRPC edge."""

from __future__ import annotations

import grpc
import redis.asyncio as aioredis

from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import Unavailable
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.status import unimplemented_servicer
from omniflow_services.kv_index.config import KVIndexSettings

PendingKVIndex = unimplemented_servicer(
    kvindex_pb2_grpc.KVIndexServiceServicer, "the KV index (Data Flow)"
)


class KVIndexApp(ServiceApp):
    """The cluster-wide KV block index on Redis."""

    name = "kv-index"

    def __init__(self, settings: KVIndexSettings) -> None:
        self.settings = settings
        self.redis: aioredis.Redis | None = None

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        kvindex_pb2_grpc.add_KVIndexServiceServicer_to_server(PendingKVIndex(), server)
        return [kvindex_pb2.DESCRIPTOR.services_by_name["KVIndexService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.redis = aioredis.from_url(
            self.settings.redis_url, socket_timeout=self.settings.call_timeout_s
        )
        try:
            await self.redis.ping()
        except Exception as exc:
            raise Unavailable(f"Redis at {self.settings.redis_url} does not answer: {exc}") from exc

    async def stop(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
