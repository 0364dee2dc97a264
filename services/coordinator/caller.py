"""The coordinator's WorkerCaller over gRPC: the router's ``Pick`` and worker stubs.

Each operation of the table (``omniflow.operations``) is called through the WorkerService
method its ``rpc`` names (``llm.generate`` → Generate, ``talker.synthesize`` → Synthesize,
``encoder.encode`` → Encode, ``diffusion.generate_image`` → GenerateImage), its params read
with the table's types and defaults; any other operation (the table's ``Invoke`` ones and
those users register) goes through ``Invoke`` with the node's params merged into its
inputs. Cancelling the awaiting task cancels the RPC, so a cancelled run or a missed
deadline also ends the call on the worker.

The Pick of a call whose operation's ``hints`` come from its prompt (``llm.generate``)
carries KV hints (namespace and the prompt's block hashes, see ``kvhints``) whenever the
call may be routed ``kv_aware``: its strategy says so, or it leaves the choice to the
router and the router's default for the role is ``kv_aware`` (learnt from Pick replies;
assumed until the first reply says otherwise).
The worker then gets the same token ids the hashes were made from (tokenized once, here);
a node with param ``chat`` sends its prompt as one user message (after ``system``, when
set), rendered with the model's own chat template.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.errors import InvalidArgument
from omniflow.finish import finish_from_proto
from omniflow.kv.wire import namespace_fields, parse_namespace, read_namespace, set_namespace
from omniflow.operations import operation as table_op
from omniflow.outcomes import OutcomeReports
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.sampling import SamplingParams
from omniflow.values import Tokens, from_python, to_python
from omniflow_services.coordinator.calls import UNUSED_PICK_CODE, CallRequest, ChunkSink, Target
from omniflow_services.coordinator.conversation import conversation, encode_items, has_conversation
from omniflow_services.coordinator.kvhints import KVHinter, Prompt, pages_hints

log = logging.getLogger(__name__)


def sampling_params(params: dict[str, Any]) -> common_pb2.SamplingParams:
    """A node's sampling params on the wire: every contract field it sets, the node
    defaults for the rest (``omniflow.sampling.NODE_DEFAULTS``); InvalidArgument naming a
    bad param."""
    return SamplingParams.from_params(params).to_proto()


def node_overrides(
    graph: cpb.WorkflowGraph, node_params: Mapping[str, common_pb2.StructValue]
) -> dict[str, dict[str, Any]]:
    """A run's ``node_params`` as Python params per top-level call node (the executor merges
    them over the node's own). InvalidArgument for a name that is not a top-level call node
    of the graph."""
    calls = {n.name for n in graph.nodes if n.WhichOneof("kind") == "call"}
    for name in node_params:
        if name not in calls:
            raise InvalidArgument(
                f"node_params names {name!r}, not a top-level call node of workflow "
                f"{graph.name!r} (its call nodes: {', '.join(sorted(calls)) or 'none'})"
            )
    return {n: {k: to_python(v) for k, v in p.fields.items()} for n, p in node_params.items()}


_GENERATE = table_op("llm", "generate")
_IMAGE = table_op("diffusion", "generate_image")
_SYNTHESIZE = table_op("talker", "synthesize")
assert _GENERATE is not None and _IMAGE is not None and _SYNTHESIZE is not None


def llm_prompt(text: str, params: dict[str, Any]) -> Prompt:
    """The prompt of an llm generate node: its text, a chat turn when param ``chat``."""
    return Prompt(text, _GENERATE.param(params, "chat"), _GENERATE.param(params, "system"))


def chat_request(prompt: Prompt) -> worker_pb2.ChatMessages:
    """The worker's chat messages of ``prompt`` (the worker renders the template)."""
    return worker_pb2.ChatMessages(
        messages=[
            worker_pb2.ChatMessage(
                role=m["role"], content=[worker_pb2.ContentPart(text=m["content"])]
            )
            for m in prompt.messages()
        ],
        add_generation_prompt=True,
    )


def image_request(req: CallRequest) -> worker_pb2.GenerateImageRequest:
    """The GenerateImage request of a generate_image call: the ``pages`` input (an llm's
    prefill_only pages, pulled by the diffusion worker) or the ``prompt`` text; inputs
    width/height/steps/seed, when given, over the node's params of the same name."""
    p = {**req.params, **{k: v for k, v in req.inputs.items() if v is not None}}
    msg = worker_pb2.GenerateImageRequest(
        request_id=req.request_id,
        width=_IMAGE.param(p, "width"),
        height=_IMAGE.param(p, "height"),
        steps=_IMAGE.param(p, "steps"),
        guidance_scale=float(_IMAGE.param(p, "guidance_scale")),
        negative_prompt=_IMAGE.param(p, "negative_prompt"),
        return_ref=_IMAGE.param(p, "return_ref"),
    )
    seed = _IMAGE.param(p, "seed")
    if seed is not None:
        msg.seed = seed
    pages = req.inputs.get("pages")
    if pages is not None:
        if not isinstance(pages, dict):
            raise InvalidArgument(
                f"input 'pages' is {type(pages).__name__}; accepted: the 'pages' output of an "
                "llm generate call with param prefill_only"
            )
        text = str(pages.get("kv_namespace", ""))  # the value keeps the hex a person reads
        try:
            ns_fields = namespace_fields(parse_namespace(text), "kv_namespace")
        except InvalidArgument:
            ns_fields = {"kv_namespace": text}  # the worker refuses it, naming the field
        msg.prompt_pages.CopyFrom(
            worker_pb2.PromptPages(
                token_ids=common_pb2.TokenIds(ids=list(pages.get("token_ids") or ())),
                **ns_fields,
                block_hashes=list(pages.get("block_hashes") or ()),
            )
        )
    else:
        msg.text = str(req.inputs.get("prompt") or "")
    return msg


KV_AWARE = router_pb2.STRATEGY_KV_AWARE
# With a history or media the Pick goes without hints: a hint covers one user turn only.
_NO_HINTS = ("messages", "media")


class GrpcWorkerCaller:
    """Picks through the router and calls workers over cached channels."""

    def __init__(
        self,
        router: Callable[[], Awaitable[router_pb2_grpc.RouterServiceStub]],
        *,
        pick_timeout_s: float = 2.0,
        call_timeout_s: float = 300.0,
        hinter: KVHinter | None = None,
    ) -> None:
        self._router = router
        self.hinter = hinter
        self._role_default: dict[str, int] = {}  # role -> strategy the router used for 0
        self.pick_timeout_s, self.call_timeout_s = pick_timeout_s, call_timeout_s
        self._channels: dict[str, TracedChannel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerServiceStub] = {}
        self._outcomes = OutcomeReports(router, pick_timeout_s)

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        # One channel and one stub per worker address: a stub builds a callable per
        # method, too much to redo on every call.
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(
                address, default_timeout_s=self.call_timeout_s, max_in_flight=None
            )
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerServiceStub(channel)
        return stub

    def _kv_routed(self, role: str, strategy: int) -> bool:
        """Whether a call of ``role`` with ``strategy`` may be routed kv_aware."""
        return strategy == KV_AWARE or (
            strategy == 0 and self._role_default.get(role, KV_AWARE) == KV_AWARE
        )

    def _wants_hints(self, role: str, operation: str, strategy: int) -> bool:
        op = table_op(role, operation)
        if self.hinter is None or op is None or op.hints != "prompt":
            return False
        return self._kv_routed(role, strategy)

    def pick_reads(self, role: str, operation: str, strategy: int) -> tuple[str, ...]:
        """Inputs whose values the Pick of such a call carries (the prompt, for hints; the
        pages of a generate_image call, whose own hashes are its hints)."""
        op = table_op(role, operation)
        if op is not None and op.hints == "pages" and self._kv_routed(role, strategy):
            return ("pages",)
        return ("prompt", *_NO_HINTS) if self._wants_hints(role, operation, strategy) else ()

    async def pick(self, req: CallRequest, exclude: tuple[str, ...]) -> Target:
        stub = await self._router()
        timeout = self.pick_timeout_s
        if req.timeout_s is not None:
            timeout = min(timeout, req.timeout_s)
        prompt = req.inputs.get("prompt")
        msg = router_pb2.PickRequest(
            role=req.role,
            strategy=req.strategy,  # type: ignore[arg-type]
            session_key=req.session_key,
            exclude_worker_ids=list(exclude),
            operation=req.operation,
            prompt_tokens=len(prompt) // 4 if isinstance(prompt, str) else 0,
        )
        if (
            self.hinter is not None
            and isinstance(prompt, str)
            and not has_conversation(req.inputs)
            and self._wants_hints(req.role, req.operation, req.strategy)
        ):
            hints = await self.hinter.hints(req.role, llm_prompt(prompt, req.params))
            if hints is not None:
                set_namespace(msg, hints.namespace, "kv_namespace")
                msg.block_hashes.extend(hints.block_hashes)
                msg.prompt_tokens = hints.prompt_tokens
        pages = req.inputs.get("pages")
        op = table_op(req.role, req.operation)
        if (
            op is not None
            and op.hints == "pages"
            and pages is not None
            and self._kv_routed(req.role, req.strategy)
        ):
            # The node holding the producing call's stored pages wins (router kv_aware).
            paged = pages_hints(pages)
            if paged is not None:
                set_namespace(msg, paged.namespace, "kv_namespace")
                msg.block_hashes.extend(paged.block_hashes)
                msg.prompt_tokens = paged.prompt_tokens
                # Its agent acknowledged them before the reply: count them before the index
                # announces them (this Pick follows that reply at once).
                msg.kv_stored_node = str(pages.get("node") or "")
        reply = await stub.Pick(msg, timeout=timeout)
        if req.strategy == 0:
            self._role_default[req.role] = reply.strategy
        w = reply.worker
        return Target(
            w.worker_id, w.address, read_namespace(w, "kv_namespace", optional=True), w.node
        )

    async def invoke(
        self, target: Target, req: CallRequest, on_chunk: ChunkSink | None
    ) -> dict[str, Any]:
        stub = self._stub(target.address)
        op = table_op(req.role, req.operation)
        rpc = op.rpc if op is not None else "Invoke"
        # A failed call raises its domain error (the channel maps it).
        if rpc == "Generate":
            return await self._generate(stub, target, req, on_chunk)
        if rpc == "Synthesize":
            return await self._synthesize(stub, req, on_chunk)
        if rpc == "Encode":
            return await self._encode(stub, req)
        if rpc == "GenerateImage":
            return await self._image(stub, req)
        inputs = {**req.params, **req.inputs}
        reply = await stub.Invoke(
            worker_pb2.InvokeRequest(
                request_id=req.request_id,
                operation=req.operation,
                inputs={k: from_python(v, f"input {k!r}") for k, v in inputs.items()},
            ),
            timeout=req.timeout_s,
        )
        return {k: to_python(v) for k, v in reply.outputs.items()}

    async def _generate(
        self,
        stub: worker_pb2_grpc.WorkerServiceStub,
        target: Target,
        req: CallRequest,
        on_chunk: ChunkSink | None,
    ) -> dict[str, Any]:
        text = req.inputs.get("prompt")
        if text is None and req.inputs.get("media"):
            text = ""  # a turn of media alone
        if not isinstance(text, str):
            raise InvalidArgument("generate needs a text input 'prompt'")
        prompt = llm_prompt(text, req.params)
        msg = worker_pb2.GenerateRequest(
            request_id=req.request_id,
            sampling=sampling_params(req.params),
            session_key=str(req.inputs.get("session") or req.session_key),
            prefill_only=_GENERATE.param(req.params, "prefill_only"),
        )
        ready = None
        history = has_conversation(req.inputs)
        if self.hinter is not None and req.role == "llm" and not history:
            ready = await self.hinter.prepared(req.role, prompt, target.kv_namespace)
        if history:  # the worker templates the whole conversation, media included
            msg.messages.CopyFrom(conversation(text, req.inputs, req.params))
        elif ready is not None:  # the ids the Pick's hashes came from: no second tokenizing
            msg.token_ids.ids.extend(ready.token_ids)
        elif prompt.chat:
            msg.messages.CopyFrom(chat_request(prompt))
        else:
            msg.text = text
        call = stub.Generate(msg, timeout=req.timeout_s)
        parts: list[str] = []
        out: dict[str, Any] = {"finish_reason": ""}
        async for chunk in call:
            if chunk.text:
                parts.append(chunk.text)
                if on_chunk is not None:
                    await on_chunk("text", chunk.text)
            if chunk.finish_reason:
                out["finish_reason"] = finish_from_proto(chunk.finish_reason)
                out["prompt_tokens"] = chunk.usage.prompt_tokens
                out["cached_tokens"] = chunk.usage.cached_tokens
                out["completion_tokens"] = chunk.usage.completion_tokens
                if chunk.prompt_token_ids.ids:  # prefill_only: the stored pages, to pull
                    out["pages"] = {
                        "kv_namespace": target.kv_namespace.hex(),
                        "block_hashes": list(chunk.prompt_block_hashes),
                        "token_ids": Tokens(chunk.prompt_token_ids.ids),
                        "node": target.node,  # whose kv-agent acknowledged storing them
                    }
        out["text"] = "".join(parts)
        return out

    async def _synthesize(
        self, stub: worker_pb2_grpc.WorkerServiceStub, req: CallRequest, on_chunk: ChunkSink | None
    ) -> dict[str, Any]:
        call = stub.Synthesize(
            worker_pb2.SynthesizeRequest(
                request_id=req.request_id,
                text=str(req.inputs.get("text", "")),
                voice=_SYNTHESIZE.param(req.params, "voice"),
                sample_rate=_SYNTHESIZE.param(req.params, "sample_rate"),
            ),
            timeout=req.timeout_s,
        )
        pcm: list[bytes] = []
        out: dict[str, Any] = {"wav": b"", "sample_rate": 0}
        async for chunk in call:
            pcm.append(chunk.pcm_s16le)
            out["sample_rate"] = chunk.sample_rate
            if on_chunk is not None and chunk.pcm_s16le:
                await on_chunk("pcm", chunk.pcm_s16le)
            if chunk.last:
                out["wav"] = chunk.wav
        out["pcm"] = b"".join(pcm)
        return out

    async def _encode(
        self, stub: worker_pb2_grpc.WorkerServiceStub, req: CallRequest
    ) -> dict[str, Any]:
        items = encode_items(req.inputs)
        reply = await stub.Encode(
            worker_pb2.EncodeRequest(request_id=req.request_id, items=items),
            timeout=req.timeout_s,
        )
        return {
            "items": [{"item_id": i.item_id, "embeddings": i.embeddings} for i in reply.items],
            "cache_hits": reply.cache_hits,
        }

    async def _image(
        self, stub: worker_pb2_grpc.WorkerServiceStub, req: CallRequest
    ) -> dict[str, Any]:
        reply = await stub.GenerateImage(image_request(req), timeout=req.timeout_s)
        image: Any = reply.ref if reply.HasField("ref") else reply.png
        return {
            "image": image,
            "width": reply.width,
            "height": reply.height,
            "prompt_tokens": reply.prompt_tokens,
            "cached_prompt_tokens": reply.cached_prompt_tokens,
        }

    async def report(self, target: Target, ok: bool, latency_ms: float, code: str) -> None:
        # Off the critical path, batched (omniflow.outcomes); failures at once, so that
        # breakers react quickly, but a released pick can wait.
        urgent = not ok and code != UNUSED_PICK_CODE
        self._outcomes.add(target.worker_id, ok, latency_ms, code, urgent=urgent)

    async def close(self) -> None:
        await self._outcomes.close()
        if self.hinter is not None:
            await self.hinter.close()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
