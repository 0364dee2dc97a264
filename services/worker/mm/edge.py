"""The worker's gRPC edge for the multimodal roles: Encode, GenerateImage, Synthesize and the
media parts of Generate. Protobuf in, plain dataclasses to the role cores, protobuf out.

Embeddings travel in the data plane: the encoder puts them into its node's kv-agent and
answers with ``TensorRef``s; the LLM reads them back only when it must compute the span.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.discovery import find_address
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes
from omniflow.kv.tensor_client import TensorClient
from omniflow.kv.wire import read_namespace
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.rpc.server import Runtime
from omniflow.sampling import SamplingParams
from omniflow.security.kvsalt import salted_extra_keys
from omniflow.workers import WORKER_SERVICE, worker_from_instance
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.llm.role import LLMRole
from omniflow_services.worker.llm.types import GenerateRequest
from omniflow_services.worker.mm import audio_metrics
from omniflow_services.worker.mm.media import AUDIO, IMAGE, MediaInput
from omniflow_services.worker.mm.media_prompt import EncodedRef, MediaResolver, multimodal_request
from omniflow_services.worker.mm.prompt import PLACEHOLDER

log = logging.getLogger(__name__)

_KINDS = {common_pb2.MediaItem.KIND_IMAGE: IMAGE, common_pb2.MediaItem.KIND_AUDIO: AUDIO}
ENCODE_TIMEOUT_S = 60.0


def _kind(item: common_pb2.MediaItem, name: str) -> str:
    kind = _KINDS.get(item.kind)
    if kind is None:
        mime = item.mime_type.split("/", 1)[0]
        kind = {"image": IMAGE, "audio": AUDIO}.get(mime, "")
    if not kind:
        raise InvalidArgument(
            f"{name}: media kind is unspecified; set kind (KIND_IMAGE, KIND_AUDIO) or a "
            "mime_type image/* or audio/*"
        )
    return kind


def has_media(request: worker_pb2.GenerateRequest) -> bool:
    """Whether the prompt has media parts, items, or placeholders (which need items)."""
    kind = request.WhichOneof("prompt")
    if len(request.items) or (kind == "text" and PLACEHOLDER.search(request.text)):
        return True
    if kind != "messages":
        return False
    return any(p.WhichOneof("part") != "text" for m in request.messages.messages for p in m.content)


class MultimodalEdge:
    """Data-plane clients and the multimodal RPC bodies of one worker."""

    def __init__(
        self, settings: WorkerSettings, core: WorkerCore, runtime: Callable[[], Runtime | None]
    ) -> None:
        self.settings = settings
        self.core = core
        self._runtime = runtime
        self._tensors: TensorClient | None = None
        self._resolvers: dict[int, MediaResolver] = {}
        self._refs: OrderedDict[bytes, common_pb2.TensorRef] = OrderedDict()
        self._channels: dict[str, TracedChannel] = {}

    async def close(self) -> None:
        if self._tensors is not None:
            await self._tensors.close()
        for ch in self._channels.values():
            await ch.close()

    # --- discovery -------------------------------------------------------------------------

    async def _pick(self, service: str, role: str = "") -> str:
        rt = self._runtime()
        return await find_address(
            rt.registry if rt is not None else None,
            service,
            node=rt.node if rt is not None else "",
            where=(lambda i: worker_from_instance(i).role == role) if role else None,
            what=role,
        )

    async def tensors(self) -> TensorClient:
        """The client of this node's kv-agent (settings first, then discovery)."""
        if self._tensors is None:
            addr = self.settings.kv_agent_addr or await self._pick("kv-agent")
            self._tensors = TensorClient(addr)
        return self._tensors

    async def _encode_remote(self, items: list[MediaInput]) -> list[tuple[bytes, Any]]:
        addr = await self._pick(WORKER_SERVICE, "encoder")
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = open_channel(addr, default_timeout_s=ENCODE_TIMEOUT_S)
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.EncodeRequest(
            items=[
                common_pb2.MediaItem(
                    kind=common_pb2.MediaItem.KIND_IMAGE
                    if it.kind == IMAGE
                    else common_pb2.MediaItem.KIND_AUDIO,
                    data=it.data,
                )
                for it in items
            ]
        )
        # The channel raises the encoder's failure as its domain error (TracedChannel).
        reply = await stub.Encode(req, timeout=ENCODE_TIMEOUT_S)
        return [(e.item_id, e.embeddings) for e in reply.items]

    def resolver(self, llm: LLMRole) -> MediaResolver:
        hidden = llm.engine.model_config.hidden_size
        r = self._resolvers.get(hidden)
        if r is None:
            r = self._resolvers[hidden] = MediaResolver(hidden, self.tensors, self._encode_remote)
        return r

    # --- Generate with media ---------------------------------------------------------------

    async def _media_input(self, item: common_pb2.MediaItem, name: str) -> MediaInput:
        kind = _kind(item, name)
        if item.WhichOneof("source") == "ref":
            raw = await (await self.tensors()).get(item.ref)
            return MediaInput(
                kind, np.ascontiguousarray(raw).reshape(-1).view(np.uint8).tobytes(), name
            )
        return MediaInput(kind, item.data, name)

    async def _part(self, part: worker_pb2.ContentPart, name: str) -> Any:
        which = part.WhichOneof("part")
        if which == "text":
            return part.text
        if which == "media":
            return await self._media_input(part.media, name)
        if which == "encoded":
            return EncodedRef(part.encoded.item_id, part.encoded.embeddings, "", name)
        raise InvalidArgument(f"{name} is empty: set text, media or encoded")

    async def generate_request(
        self, llm: LLMRole, request: worker_pb2.GenerateRequest, rid: str, params: SamplingParams
    ) -> tuple[GenerateRequest, list[bytes]]:
        """The engine request of a prompt with media, and its prompt block hashes."""
        engine = llm.engine
        resolver = self.resolver(llm)
        kind = request.WhichOneof("prompt")
        if kind == "messages":
            turns = []
            for i, m in enumerate(request.messages.messages):
                parts = [
                    await self._part(p, f"messages[{i}].content[{j}]")
                    for j, p in enumerate(m.content)
                ]
                turns.append((m.role, parts))
            req, prompt = await multimodal_request(
                engine,
                llm.prep,
                resolver,
                rid,
                params,
                turns=turns,
                add_generation_prompt=request.messages.add_generation_prompt,
            )
        elif kind == "text":
            items = []
            for k, p in enumerate(request.items):
                got = await self._part(p, f"items[{k}]")
                if isinstance(got, str):
                    raise InvalidArgument(f"items[{k}] is text; items are media or encoded parts")
                if isinstance(got, EncodedRef):
                    got = EncodedRef(got.item_id, got.ref, _ref_kind(request.text, k), got.name)
                items.append(got)
            req, prompt = await multimodal_request(
                engine, llm.prep, resolver, rid, params, text=request.text, items=items
            )
        else:
            raise InvalidArgument("media items need a text or messages prompt, not token_ids")
        layout = engine.layout
        # The caller's tenant salts the hashes, as for text prompts (omniflow.security.kvsalt).
        extra = salted_extra_keys(prompt.extra_keys)
        if extra is not prompt.extra_keys:
            req = dataclasses.replace(req, extra_keys=extra)
        hashes = block_hashes(layout.namespace, prompt.tokens, layout.page_size, extra)
        return req, hashes

    # --- Encode ----------------------------------------------------------------------------

    async def encode(self, request: worker_pb2.EncodeRequest) -> worker_pb2.EncodeResponse:
        enc = self.core.require_mm("encoder").encoder
        assert enc is not None
        if not request.items:
            raise InvalidArgument("items is empty: send at least one media item")
        items = [await self._media_input(it, f"items[{i}]") for i, it in enumerate(request.items)]
        results = await enc.encode(items)
        tensors = await self.tensors()
        reply = worker_pb2.EncodeResponse()
        now_ms = time.time() * 1000
        for r in results:
            ref = self._refs.get(r.item_id)
            # A ref still alive for a while is reused: the bytes are the same (same item id).
            if ref is None or (ref.expires_at_unix_ms and ref.expires_at_unix_ms < now_ms + 30_000):
                ref = await tensors.put(r.embeddings.float().numpy())
                self._refs[r.item_id] = ref
                while len(self._refs) > 4096:
                    self._refs.popitem(last=False)
            reply.items.append(worker_pb2.EncodedItem(item_id=r.item_id, embeddings=ref))
            reply.cache_hits += int(r.cached)
        return reply

    # --- GenerateImage ---------------------------------------------------------------------

    async def generate_image(
        self, request: worker_pb2.GenerateImageRequest
    ) -> worker_pb2.GenerateImageResponse:
        mm = self.core.require_mm("diffusion")
        # Imported here: the diffusion role loads torch, and every worker imports this edge.
        from omniflow_services.worker.mm.image_role import ImageRequest

        role, llm = mm.diffusion, mm.llm
        assert role is not None and llm is not None
        cfg = role.defaults
        which = request.WhichOneof("prompt")
        if which == "text":
            if not request.text:
                raise InvalidArgument("text is empty: describe the image to generate")
            ids = await llm.encode_chat([{"role": "user", "content": request.text}])
        elif which == "prompt_pages":
            ids = self._prompt_pages(llm, request.prompt_pages)
        else:
            raise InvalidArgument("the request has no prompt: set text or prompt_pages")
        # The same template as any chat: the prompt (and its pages) match an llm's prefill
        # of the same user message, e.g. one made with prefill_only for prompt_pages.
        neg = await llm.encode_chat([{"role": "user", "content": request.negative_prompt}])
        size = int(cfg["default_size"])
        result = await role.generate(
            ImageRequest(
                request.request_id or "image",
                ids,
                neg,
                request.width or size,
                request.height or size,
                request.steps or int(cfg["default_steps"]),
                request.guidance_scale or float(cfg["default_guidance"]),
                request.seed if request.HasField("seed") else None,
            )
        )
        reply = worker_pb2.GenerateImageResponse(
            width=result.width,
            height=result.height,
            prompt_tokens=result.prompt_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
        )
        if request.return_ref:
            import io

            from PIL import Image

            rgb = np.asarray(Image.open(io.BytesIO(result.png)).convert("RGB"))
            reply.ref.CopyFrom(await (await self.tensors()).put(rgb))
        else:
            reply.png = result.png
        return reply

    def _prompt_pages(self, llm: LLMRole, pages: worker_pb2.PromptPages) -> list[int]:
        layout = llm.engine.layout
        namespace = read_namespace(pages, "kv_namespace", optional=True)
        if namespace and namespace != layout.namespace:
            raise InvalidArgument(
                f"prompt_pages.kv_namespace {namespace.hex()} is not this backbone's "
                f"({layout.namespace.hex()}); the pages come from another model"
            )
        ids = list(pages.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt_pages.token_ids is empty")
        # Pages an llm stored for this tenant hash with its salt (security.tenancy).
        want = block_hashes(layout.namespace, ids, layout.page_size, salted_extra_keys(None))
        given = list(pages.block_hashes)
        if given != want[: len(given)]:
            raise InvalidArgument(
                "prompt_pages.block_hashes do not match its token ids under this namespace "
                "(the pages were made from another prompt)"
            )
        return ids

    # --- Synthesize ------------------------------------------------------------------------

    async def synthesize(
        self, request: worker_pb2.SynthesizeRequest
    ) -> AsyncIterator[worker_pb2.SynthesizeResponse]:
        talker = self.core.require_mm("talker").talker
        assert talker is not None
        # 0 → 16 kHz from every talker; 8 to 48 kHz resampled (see mm/talker.py).
        rate = talker.output_rate(request.sample_rate)
        talker.check_voice(request.voice)
        seed = request.seed if request.HasField("seed") else None
        chunks = talker.synthesize(request.text, seed, sample_rate=rate)
        async for ch in audio_metrics.timed_chunks(chunks):
            yield worker_pb2.SynthesizeResponse(
                pcm_s16le=ch.pcm_s16le,
                sample_rate=ch.sample_rate,
                chunk_index=ch.index,
                last=ch.last,
                wav=ch.wav,
            )


def _ref_kind(text: str, k: int) -> str:
    """The kind of the ``k``-th placeholder of ``text`` (encoded items carry no kind)."""
    marks = PLACEHOLDER.findall(text)
    return marks[k] if k < len(marks) else ""
