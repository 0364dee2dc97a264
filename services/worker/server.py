"""The worker's gRPC edge: WorkerService for one role."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.errors import InvalidArgument
from omniflow.finish import finish_to_proto
from omniflow.kv.wire import layout_to_proto, namespace_fields
from omniflow.prompt_size import check_prompt_size, ids_bytes, text_bytes
from omniflow.records import build
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.servicer import AppServicer
from omniflow.rpc.status import unimplemented
from omniflow.sampling import SamplingParams
from omniflow.workers import WORKER_SERVICE, worker_metadata
from omniflow_services.worker import metrics
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.echo.edge import invoke_echo, synthesize_echo
from omniflow_services.worker.embed.edge import invoke_embed
from omniflow_services.worker.kv import WorkerKV
from omniflow_services.worker.llm.role import LLMRole
from omniflow_services.worker.mm.audio_edge import invoke_audio
from omniflow_services.worker.mm.edge import MultimodalEdge, has_media

log = logging.getLogger(__name__)


def chat_messages(messages: worker_pb2.ChatMessages) -> list[dict[str, Any]]:
    """Proto chat messages of text parts → the OpenAI-style dicts chat templates render."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages.messages):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(m.content):
            if part.WhichOneof("part") != "text":
                raise InvalidArgument(
                    f"messages[{i}].content[{j}] is a media part: media in prompts needs "
                    "the multimodal path (an llm worker with an encoder reachable)"
                )
            parts.append({"type": "text", "text": part.text})
        out.append({"role": m.role, "content": parts})
    return out


def check_prompt_bytes(request: worker_pb2.GenerateRequest, most: int) -> None:
    """A prompt past ``most`` bytes (``omniflow.prompt_size``: text, messages or token ids,
    4 bytes each) is refused before anything is done with it: tokenizing 20 MB took 16 s and
    grew the worker by 4.6 GB, for a prompt the context cannot hold."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        size = text_bytes(request.text)
    elif kind == "messages":
        size = request.messages.ByteSize()
    elif kind == "token_ids":
        size = ids_bytes(request.token_ids.ids)
    else:
        return
    check_prompt_size(size, most, "OMNIFLOW_WORKER_MAX_PROMPT_BYTES", f"the {kind} prompt")


async def prompt_ids(llm: LLMRole, request: worker_pb2.GenerateRequest) -> list[int]:
    """The prompt's token ids: ``token_ids`` as given (never re-tokenized); ``text`` with
    the tokenizer's special tokens; ``messages`` through the model's chat template. The
    tokenizing runs on a thread."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "text":
        return await llm.encode_text(request.text)
    if kind == "messages":
        messages = chat_messages(request.messages)
        return await llm.encode_chat(messages, request.messages.add_generation_prompt)
    raise InvalidArgument("the request has no prompt: set text, token_ids or messages")


class WorkerServicer(AppServicer["WorkerApp"], worker_pb2_grpc.WorkerServiceServicer):
    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        llm = self.app.core.require_llm()
        check_prompt_bytes(request, self.app.settings.max_prompt_bytes)
        params = SamplingParams.from_proto(request.sampling)  # max_tokens: the engine's
        if request.return_logprobs and not params.logprobs:  # the deprecated spelling
            params = replace(params, logprobs=True)
        if request.prefill_only:
            params = SamplingParams(max_tokens=1, temperature=0.0)
        shown, rid = llm.request_id(request.request_id)  # rid: scoped to the caller
        if has_media(request):
            req, hashes = await self.app.mm.generate_request(llm, request, rid, params)
            ids, stream = req.prompt_token_ids, llm.engine.generate(req)
        else:
            ids = await prompt_ids(llm, request)
            hashes, stream = None, llm.generate(rid, ids, params)
        # Closing this generator (client gone, deadline) closes the engine stream: aborted.
        async for out in metrics.timed(stream):
            reply = worker_pb2.GenerateResponse(
                request_id=shown, token_ids=out.new_token_ids, text=out.text_delta
            )
            if out.logprobs is not None:
                reply.logprobs.extend(out.logprobs)
            for top in out.top_logprobs or ():
                reply.top_logprobs.add(token_ids=top.token_ids, logprobs=top.logprobs)
            if out.finished:
                reply.finish_reason = finish_to_proto(out.finish_reason)
                reply.usage.CopyFrom(
                    common_pb2.Usage(
                        prompt_tokens=out.usage.prompt_tokens,
                        cached_tokens=out.usage.cached_tokens,
                        completion_tokens=out.usage.generated_tokens,
                    )
                )
                reply.prompt_block_hashes.extend(
                    hashes if hashes is not None else llm.prompt_hashes(ids)
                )
                if request.prefill_only:
                    reply.prompt_token_ids.ids.extend(ids)
                    await self._pages_stored(rid, reply.prompt_block_hashes)
            yield reply

    async def _pages_stored(self, rid: str, hashes: Sequence[bytes]) -> None:
        """prefill_only promises its full pages can be pulled by another role: the reply
        waits (bounded) for the agent to acknowledge their write-through."""
        kv, timeout_s = self.app.kv, self.app.settings.prefill_store_timeout_s
        if not isinstance(kv, WorkerKV):  # vLLM/SGLang share pages their own way
            return
        if not await kv.wait_stored(hashes, timeout_s):
            metrics.PREFILL_STORE_INCOMPLETE.inc()
            log.warning(
                "request %s: prefill_only replies before its pages are all stored in the "
                "kv-agent (not attached, a store failed, or over %.1fs)",
                rid,
                timeout_s,
            )

    async def Encode(
        self, request: worker_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EncodeResponse:
        return await self.app.mm.encode(request)

    async def GenerateImage(
        self, request: worker_pb2.GenerateImageRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GenerateImageResponse:
        return await self.app.mm.generate_image(request)

    async def Synthesize(
        self, request: worker_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SynthesizeResponse]:
        echo = self.app.core.echo
        stream = synthesize_echo(echo, request) if echo else self.app.mm.synthesize(request)
        async for chunk in stream:
            yield chunk

    async def LoadModel(
        self, request: worker_pb2.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadModelResponse:
        if request.engine not in ("", "torch"):
            raise InvalidArgument(
                f"engine {request.engine!r} cannot be loaded at run time; accepted: torch "
                "(start the worker with OMNIFLOW_WORKER_ENGINE=sglang for SGLang)"
            )
        if not request.model_path:
            raise InvalidArgument("model_path is required (a folder, or tiny:qwen2 / tiny:llama)")
        core = self.app.core
        await core.load(request.model_path, request.dtype or None)
        await self.app.attach_kv()
        if self.app.runtime is not None and self.app.runtime.reregister is not None:
            await self.app.runtime.reregister()  # the router sees the new namespace
        if core.llm is None:  # encoder or talker: no KV namespace
            return worker_pb2.LoadModelResponse(model=core.model)
        layout = core.require_llm().engine.layout
        return worker_pb2.LoadModelResponse(
            model=core.model,
            **namespace_fields(core.kv_namespace, "kv_namespace"),
            kv_layout=layout_to_proto(layout),
        )

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        llm = self.app.core.require_llm()
        return worker_pb2.AbortResponse(found=llm.abort(request.request_id))

    async def Invoke(
        self, request: worker_pb2.InvokeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InvokeResponse:
        if self.app.core.echo is not None:  # the echo engine serves its own operations
            rt = self.app.runtime
            return await invoke_echo(self.app.core.echo, request, rt.instance_id if rt else "")
        # Each handler asks for its role (FailedPrecondition naming this worker's role).
        handler = next((h for (_, op), h in INVOKE.items() if op == request.operation), None)
        if handler is None:
            raise unimplemented("user-registered operations (Control Flow)")
        return await handler(self.app, request)

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        load = self.app.core.load_now()  # free_pages and total_pages under the same names
        wire = build(
            common_pb2.WorkerLoad,
            load,
            running_requests=load.running,
            waiting_requests=load.waiting,
        )
        return worker_pb2.GetLoadResponse(load=wire)

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
            **namespace_fields(core.kv_namespace, "kv_namespace"),
            operations=list(core.operations),
            healthy=True,
        )
        if core.llm is None:  # no KV pages: no layout
            return worker_pb2.GetInfoResponse(info=info)
        layout = layout_to_proto(core.llm.engine.layout)
        return worker_pb2.GetInfoResponse(info=info, kv_layout=layout)


InvokeHandler = Callable[
    ["WorkerApp", worker_pb2.InvokeRequest], Awaitable[worker_pb2.InvokeResponse]
]

#: The operations this edge serves through Invoke, by (role, operation) of the table
#: (``omniflow.operations``; tests/worker/test_operations_table.py holds them to it).
INVOKE: dict[tuple[str, str], InvokeHandler] = {
    ("encoder", "transcribe"): lambda app, r: invoke_audio(app.core, r, app.mm.tensors),
    ("embed", "embed"): lambda app, r: invoke_embed(app.core.require_embed(), r),
}


class WorkerApp(ServiceApp):
    """One worker process of one role."""

    name = WORKER_SERVICE

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.core = WorkerCore(settings)
        self.runtime: Runtime | None = None
        self.kv: WorkerKV | None = None
        self.mm = MultimodalEdge(settings, self.core, lambda: self.runtime)
        self._unwatch = metrics.watch(self.core)  # engine series, read at scrape time

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(self), server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        if self.settings.model or self.settings.engine == "echo":
            # SERVING only after the model is loaded and a warm-up step has run.
            await self.core.load(self.settings.model)
            await self.attach_kv()

    async def attach_kv(self) -> None:
        """Share the engine's KV through the node's agent (built-in engine only)."""
        if self.kv is not None:  # a reload: the old engine's link goes first
            await self.kv.stop()
            self.kv = None
        llm = self.core.llm
        if not self.settings.kv_connect or self.runtime is None or llm is None:
            return
        if not llm.kv_attach:
            # SGLang shares pages through its HiCache backend, vLLM through its connector;
            # a role that announces its device pages itself does so under our lease.
            attach = getattr(llm, "attach_index", None)
            if attach is not None:
                self.kv = attach(self.runtime)
            return
        self.kv = WorkerKV(self.runtime, self.settings.kv_agent_addr)
        self.kv.attach(llm.engine)

    async def stop(self) -> None:
        self._unwatch()
        if self.kv is not None:
            await self.kv.stop()
        await self.mm.close()
        if self.core.embed is not None:
            self.core.embed.close()
        if self.core.echo is not None:
            await self.core.echo.close()

    def metadata(self) -> dict[str, str]:
        node = self.runtime.node if self.runtime else ""
        c = self.core
        # Discovery metadata is a text map: the namespace as its hex there.
        meta = worker_metadata(c.role, node, c.model, c.kv_namespace.hex(), c.operations)
        if c.echo is not None:  # no page pricing: its pages are the test engine's bytes
            return {**meta, **c.echo.metadata()}
        # The page size the prompt's block hashes are cut at: the gateway and the
        # coordinator hash prompts for kv_aware picks and must cut them the same way.
        layout = getattr(getattr(c.llm, "engine", None), "layout", None)
        if layout is not None:
            meta["page_size"] = str(layout.page_size)
            # The router prices pulling a page from another node against recomputing it.
            meta["page_bytes"] = str(layout.page_bytes)
        if c.llm is not None:  # the gateway refuses a max_tokens beyond it before streaming
            meta["context_length"] = str(c.llm.context_length())
        # Which of an encoder's models transcribes: the gateway serves it by that name.
        if c.mm is not None and c.mm.encoder is not None and c.mm.encoder.transcribe_model:
            meta["transcribe_model"] = c.mm.encoder.transcribe_model
        if c.embed is not None:
            meta["embedding_dim"] = str(c.embed.dim)
        return meta
