"""What an llm engine takes and gives: requests, outputs, load and counters.

Every llm engine of the worker (the built-in one in ``engine/``, vLLM, SGLang, the echo
engine) speaks these types, and none of them imports another's. Torch-free at import time
(tensors appear in annotations only), so that an engine without torch can use them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from omniflow.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The most likely alternatives at one position, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class EmbedSpan:
    """Input embeddings for prompt positions ``[start, start + length)`` (a media item).

    The prompt holds the item's pad ids there (``omniflow.kv.blocks.apply_multimodal``).
    ``embeds`` is a ``[length, hidden]`` tensor, or a zero-argument callable returning one:
    the engine calls it only when some position of the span must be computed (not when
    the whole span is served from the prefix cache), on its step thread.
    """

    start: int
    length: int
    embeds: torch.Tensor | Callable[[], torch.Tensor]


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation request: ``prompt_token_ids`` or, when None, ``prompt`` text.

    ``extra_keys`` maps a page index to its encoded multimodal extra keys
    (``omniflow.kv.blocks.encode_extra_keys``). ``return_logits`` attaches the float32
    logits row each token was sampled from (for correctness tests and debugging).
    ``embeds`` places media embeddings at pad-id positions of the prompt. ``return_kv``
    attaches the prompt's K/V (``RequestOutput.kv``) to the first output, for a role that
    attends to the prompt afterwards (the image denoiser).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] | list[int] | None = None
    prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    extra_keys: dict[int, bytes] | None = None
    return_logits: bool = False
    embeds: tuple[EmbedSpan, ...] = ()
    return_kv: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (a stream item).

    ``finish_reason`` is None while running, else "stop", "length" or "abort".
    ``logits`` is [len(new_token_ids), vocab] when the request asked for it. ``kv`` is the
    prompt's (K, V), each ``[layers, kv_heads, prompt_len, head_dim]``, on the first output
    of a request that asked for it. ``error`` says why a request was dropped (finish
    reason "abort"), e.g. its embeddings could not be produced. ``logprobs`` (one per new
    token) and ``top_logprobs`` (one per new token) are set when the params asked for them.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    logits: torch.Tensor | None = None
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    error: BaseException | None = None
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the router weighs (the worker reports it as its load): queue depth and free
    KV pages. All zero when no engine is loaded."""

    running: int = 0
    waiting: int = 0
    free_pages: int = 0
    total_pages: int = 0


@dataclass(slots=True)
class EngineStats:
    """Counters since start; ``connector_failures`` counts fetch/store faults (recomputed);
    ``async_loads`` counts prefix fetches that ran while the batch kept stepping."""

    steps: int = 0
    batched_tokens: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    connector_hit_tokens: int = 0
    generated_tokens: int = 0
    pages_written_through: int = 0
    connector_failures: int = 0
    event_failures: int = 0
    preemptions: int = 0
    async_loads: int = 0


def unqueue(req: R, running: list[R], waiting: deque[R]) -> None:
    """Take ``req`` out of a continuous-batching engine's queues, whichever holds it (a
    request in neither, already finished, is left alone)."""
    if req in running:
        running.remove(req)
    elif req in waiting:
        waiting.remove(req)
