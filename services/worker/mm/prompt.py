"""Multimodal prompts for the LLM (DESIGN §4.1): chat turns mixing text and media items
become token ids with placeholder spans, pad ids, per-page extra keys and input embeddings.

Each item occupies as many positions as its encoder made tokens; those positions hold the
item's pad id (derived from its id, the xxh3_128 of its raw bytes) and every page the span
overlaps carries ``(item id, offset)`` as extra keys, so the same image in two turns shares
pages and two different images never do. Embeddings are fetched lazily: only when a
position of the span must be computed, not when the whole span is served from cache.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omniflow.chat import ChatTemplate
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import MultimodalSpan, apply_multimodal
from omniflow_services.worker.llm.types import EmbedSpan

if TYPE_CHECKING:
    import torch

#: Placeholders of a text prompt, matched in order with the request's items.
PLACEHOLDER = re.compile(r"<\|(image|audio)\|>")


@dataclass(frozen=True, slots=True)
class ItemEmbeddings:
    """A media item as the prompt needs it: id, span length and how to get its embeddings."""

    item_id: bytes
    num_tokens: int
    fetch: Callable[[], Awaitable[torch.Tensor]]
    name: str = "item"
    kind: str = "image"  # image or audio: the placeholder it has in a rendered chat


@dataclass(frozen=True, slots=True)
class MultimodalPrompt:
    tokens: list[int]
    extra_keys: dict[int, bytes]
    embeds: tuple[EmbedSpan, ...]
    spans: tuple[MultimodalSpan, ...]


Segment = str | ItemEmbeddings


def chat_segments(
    turns: Sequence[tuple[str, Sequence[Segment]]],
    add_generation_prompt: bool,
    template: ChatTemplate,
) -> list[Segment]:
    """The model's chat template around each turn's parts, media kept in place.

    Each item is handed to the template as its placeholder (``<|image|>``, ``<|audio|>``)
    inside the message content; the rendered prompt is then split at the placeholders and
    the items are put back there, in order.
    """
    if not turns:
        raise InvalidArgument("messages is empty: send at least one message")
    messages = []
    items: list[ItemEmbeddings] = []
    for role, parts in turns:
        content = []
        for p in parts:
            if isinstance(p, str):
                content.append({"type": "text", "text": p})
            else:
                content.append({"type": p.kind})
                items.append(p)
        messages.append({"role": role, "content": content})
    rendered = template.render(messages, add_generation_prompt)
    if len(PLACEHOLDER.findall(rendered)) != len(items):
        raise InvalidArgument(
            f"the chat template of {template.model} rendered "
            f"{len(PLACEHOLDER.findall(rendered))} media placeholders for {len(items)} media "
            "parts (a text part may not contain <|image|> or <|audio|>, and the template must "
            "keep each message's content once)"
        )
    return text_segments(rendered, items, [it.kind for it in items])


def text_segments(
    text: str, items: Sequence[ItemEmbeddings], kinds: Sequence[str]
) -> list[Segment]:
    """Split a text prompt at its placeholders and put ``items`` there, in order.

    ``kinds[i]`` is item i's media kind; a placeholder must name the same kind.
    """
    marks = list(PLACEHOLDER.finditer(text))
    if len(marks) != len(items):
        raise InvalidArgument(
            f"the prompt has {len(marks)} media placeholders (<|image|>, <|audio|>) but "
            f"{len(items)} items were sent; send one item per placeholder"
        )
    out: list[Segment] = []
    pos = 0
    for k, (m, item) in enumerate(zip(marks, items, strict=True)):
        if m.group(1) != kinds[k]:
            raise InvalidArgument(
                f"items[{k}] is {kinds[k] or 'unspecified'} but its placeholder is <|{m.group(1)}|>"
            )
        out.append(text[pos : m.start()])
        out.append(item)
        pos = m.end()
    out.append(text[pos:])
    return out


def build_prompt(
    segments: Sequence[Segment],
    tokenize: Callable[[str], list[int]],
    page_size: int,
    loop: asyncio.AbstractEventLoop,
    hidden: int,
    timeout_s: float = 30.0,
    affixes: tuple[Sequence[int], Sequence[int]] = ((), ()),
) -> MultimodalPrompt:
    """Tokens, extra keys and lazy embedding spans of ``segments``.

    Adjacent text is tokenized as one piece; each item takes ``num_tokens`` positions.
    ``affixes`` are ids put before and after the whole (a text prompt's special tokens,
    which a piecewise tokenizing leaves out). Embeddings are fetched on ``loop`` when the
    engine asks for them (from its own thread).
    """
    tokens: list[int] = list(affixes[0])
    spans: list[MultimodalSpan] = []
    embeds: list[EmbedSpan] = []
    text = ""
    for seg in [*segments, ""]:
        if isinstance(seg, str):
            text += seg
            continue
        if text:
            tokens.extend(tokenize(text))
            text = ""
        if seg.num_tokens <= 0:
            raise InvalidArgument(f"{seg.name}: the item has no embedding tokens")
        spans.append(MultimodalSpan(seg.item_id, len(tokens), seg.num_tokens))
        embeds.append(EmbedSpan(len(tokens), seg.num_tokens, _lazy(seg, loop, hidden, timeout_s)))
        tokens.extend([0] * seg.num_tokens)  # rewritten to pad ids below
    if text:
        tokens.extend(tokenize(text))
    tokens.extend(affixes[1])
    rewritten, extra = apply_multimodal(tokens, spans, page_size)
    return MultimodalPrompt(rewritten, extra, tuple(embeds), tuple(spans))


def _lazy(
    item: ItemEmbeddings, loop: asyncio.AbstractEventLoop, hidden: int, timeout_s: float
) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        emb = asyncio.run_coroutine_threadsafe(_call(item.fetch), loop).result(timeout_s)
        if tuple(emb.shape) != (item.num_tokens, hidden):
            raise InvalidArgument(
                f"{item.name}: embeddings of shape {tuple(emb.shape)}; the prompt needs "
                f"({item.num_tokens}, {hidden})"
            )
        return emb

    return load


async def _call(fetch: Callable[[], Awaitable[torch.Tensor]]) -> torch.Tensor:
    return await fetch()
