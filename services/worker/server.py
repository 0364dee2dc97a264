"""The worker's gRPC edge: WorkerService for one role."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.status import unimplemented
from omniflow.workers import WORKER_SERVICE, worker_metadata
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.core import WorkerCore

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, app: WorkerApp) -> None:
        self.app = app

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        raise unimplemented("the LLM engine (Compute Flow: LLM worker)")
        yield  # an async generator, like every streaming handler

    async def Encode(
        self, request: worker_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EncodeResponse:
        raise unimplemented("encoder roles (Compute Flow: multimodal roles)")

    async def GenerateImage(
        self, request: worker_pb2.GenerateImageRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GenerateImageResponse:
        raise unimplemented("image generation (Compute Flow: multimodal roles)")

    async def Synthesize(
        self, request: worker_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SynthesizeResponse]:
        raise unimplemented("speech output (Compute Flow: multimodal roles)")
        yield

    async def LoadModel(
        self, request: worker_pb2.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadModelResponse:
        raise unimplemented("model loading (Compute Flow: LLM worker)")

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        raise unimplemented("request abort (Compute Flow: LLM worker)")

    async def Invoke(
        self, request: worker_pb2.InvokeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InvokeResponse:
        raise unimplemented("user-registered operations (Control Flow)")

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        load = self.app.core.load()
        return worker_pb2.GetLoadResponse(
            load=common_pb2.WorkerLoad(
                running_requests=load.running,
                waiting_requests=load.waiting,
                free_pages=load.free_pages,
                total_pages=load.total_pages,
                tokens_per_second=load.tokens_per_second,
            )
        )

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetInfoResponse:
        core, rt = self.app.core, self.app.runtime
        info = common_pb2.WorkerInfo(
            worker_id=rt.instance_id if rt else "",
            role=core.role,
            address=rt.address if rt else "",
            node=rt.node if rt else "",
            model=core.model,
            kv_namespace=core.kv_namespace,
            operations=list(core.operations),
            healthy=True,
        )
        return worker_pb2.GetInfoResponse(info=info)


class WorkerApp(ServiceApp):
    """One worker process of one role."""

    name = WORKER_SERVICE

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.core = WorkerCore(settings.role, settings.model)
        self.runtime: Runtime | None = None

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(self), server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def metadata(self) -> dict[str, str]:
        node = self.runtime.node if self.runtime else ""
        c = self.core
        return worker_metadata(c.role, node, c.model, c.kv_namespace, c.operations)
