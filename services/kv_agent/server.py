"""The kv-agent gRPC edge."""

from __future__ import annotations

import grpc

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.status import unimplemented_servicer
from omniflow_services.kv_agent.config import KVAgentSettings

PendingKVAgent = unimplemented_servicer(
    kvagent_pb2_grpc.KVAgentServiceServicer, "the node KV agent (Data Flow)"
)


class KVAgentApp(ServiceApp):
    """One per node: the host and SSD tiers, and agent-to-agent transfer."""

    name = "kv-agent"

    def __init__(self, settings: KVAgentSettings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        kvagent_pb2_grpc.add_KVAgentServiceServicer_to_server(PendingKVAgent(), server)
        return [kvagent_pb2.DESCRIPTOR.services_by_name["KVAgentService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
