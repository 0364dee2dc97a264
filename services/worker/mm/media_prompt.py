"""The LLM side of multimodal prompts: media and encoded items → ``ItemEmbeddings``.

An encoded item (id + ``TensorRef``) needs no encoder: its span length is the ref's first
dimension and its embeddings are read from the data plane only if some position of the
span must be computed. A raw media item is sent to an encoder worker (``encode``); once its
id has been seen, its span length is known and a second turn whose pages are all cached
encodes nothing at all.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omniflow.chat import Preprocessor
from omniflow.errors import FailedPrecondition, InvalidArgument
from omniflow.kv.blocks import HASH_BYTES, item_id
from omniflow.kv.tensor_client import TensorClient
from omniflow.sampling import SamplingParams
from omniflow_services.worker.llm.types import GenerateRequest
from omniflow_services.worker.mm.media import IMAGE, MediaInput
from omniflow_services.worker.mm.prompt import (
    ItemEmbeddings,
    MultimodalPrompt,
    Segment,
    build_prompt,
    chat_segments,
    text_segments,
)

if TYPE_CHECKING:
    import torch

#: (item id, TensorRef of its embeddings) for each item, in order.
EncodeFn = Callable[[list[MediaInput]], Awaitable[list[tuple[bytes, Any]]]]


@dataclass(frozen=True, slots=True)
class EncodedRef:
    """An item an encoder already produced: its id and the TensorRef of its embeddings."""

    item_id: bytes
    ref: Any  # omniflow.api.common.v1.TensorRef
    kind: str = ""
    name: str = "item"


Part = str | MediaInput | EncodedRef


class MediaResolver:
    """Turns media parts into ``ItemEmbeddings`` through an encoder and the data plane."""

    def __init__(
        self,
        hidden: int,
        tensors: Callable[[], Awaitable[TensorClient]] | None,
        encode: EncodeFn | None,
        known_items: int = 4096,
    ) -> None:
        self.hidden = hidden
        self._tensors = tensors
        self._encode = encode
        self._lengths: OrderedDict[bytes, int] = OrderedDict()
        self._known_items = known_items

    async def _get(self, ref: Any, name: str) -> torch.Tensor:
        import torch

        if self._tensors is None:
            raise FailedPrecondition(
                f"{name}: embeddings are in the data plane and this worker has no kv-agent "
                "(set OMNIFLOW_KV_AGENT_ADDR or start one)"
            )
        client = await self._tensors()
        arr = await client.get(ref)
        return torch.from_numpy(np.array(arr, dtype=np.float32))

    def _remember(self, key: bytes, n: int) -> None:
        self._lengths[key] = n
        self._lengths.move_to_end(key)
        while len(self._lengths) > self._known_items:
            self._lengths.popitem(last=False)

    def encoded(self, part: EncodedRef) -> ItemEmbeddings:
        if len(part.item_id) != HASH_BYTES:
            raise InvalidArgument(
                f"{part.name}: item_id has {len(part.item_id)} bytes; item ids are "
                f"{HASH_BYTES} bytes (xxh3_128 of the item's raw bytes)"
            )
        shape = tuple(part.ref.shape)
        if len(shape) != 2 or shape[1] != self.hidden or shape[0] <= 0:
            raise InvalidArgument(
                f"{part.name}: embeddings of shape {shape}; this model needs "
                f"(tokens, {self.hidden})"
            )
        ref = part.ref
        return ItemEmbeddings(
            part.item_id,
            int(shape[0]),
            lambda: self._get(ref, part.name),
            part.name,
            part.kind or IMAGE,  # an encoded part of a chat carries no kind
        )

    async def media(self, item: MediaInput) -> ItemEmbeddings:
        key = item_id(item.data)
        n = self._lengths.get(key)
        if n is not None:  # span length known: encode only if the engine needs the embeddings
            self._remember(key, n)

            async def later() -> torch.Tensor:
                ((_, ref),) = await self._encode_checked([item])
                return await self._get(ref, item.name)

            return ItemEmbeddings(key, n, later, item.name, item.kind)
        ((got_id, ref),) = await self._encode_checked([item])
        part = self.encoded(EncodedRef(got_id, ref, item.kind, item.name))
        self._remember(key, part.num_tokens)
        return part

    async def _encode_checked(self, items: list[MediaInput]) -> list[tuple[bytes, Any]]:
        if self._encode is None:
            raise FailedPrecondition(
                f"{items[0].name}: raw media needs an encoder worker and none is reachable; "
                "start one (role encoder) or send encoded items"
            )
        try:
            return await self._encode(items)
        except InvalidArgument as exc:
            msg = str(exc)
            # The encoder names its own items[0]; name the part of this request instead.
            raise InvalidArgument(msg.replace("items[0]", items[0].name, 1)) from None

    async def resolve(self, part: MediaInput | EncodedRef) -> ItemEmbeddings:
        if isinstance(part, EncodedRef):
            return self.encoded(part)
        return await self.media(part)


async def multimodal_request(
    engine: Any,
    prep: Preprocessor,
    resolver: MediaResolver,
    request_id: str,
    params: SamplingParams,
    *,
    turns: Sequence[tuple[str, Sequence[Part]]] | None = None,
    add_generation_prompt: bool = True,
    text: str | None = None,
    items: Sequence[MediaInput | EncodedRef] = (),
) -> tuple[GenerateRequest, MultimodalPrompt]:
    """The engine request for a chat (``turns``, through the model's chat template) or a
    text prompt with placeholders. Rendering and tokenizing run on a thread."""
    affixes: tuple[list[int], list[int]] = ([], [])  # a chat's template writes its own
    if turns is not None:
        template = prep.require_template()  # before any media is encoded
        resolved: list[tuple[str, list[Segment]]] = []
        for role, parts in turns:
            segs: list[Segment] = []
            for p in parts:
                segs.append(p if isinstance(p, str) else await resolver.resolve(p))
            resolved.append((role, segs))
        segments = await asyncio.to_thread(chat_segments, resolved, add_generation_prompt, template)
    else:
        got = [await resolver.resolve(p) for p in items]
        segments = text_segments(text or "", got, [p.kind for p in items])
        affixes = prep.text_affixes()  # the tokenizer's special tokens, as for any text
    prompt = await asyncio.to_thread(
        build_prompt,
        segments,
        prep.encode_piece,  # the template (or the text) holds every special token
        engine.layout.page_size,
        asyncio.get_running_loop(),
        engine.model_config.hidden_size,
        affixes=affixes,
    )
    req = GenerateRequest(
        request_id,
        prompt_token_ids=prompt.tokens,
        params=params,
        extra_keys=prompt.extra_keys,
        embeds=prompt.embeds,
    )
    return req, prompt
