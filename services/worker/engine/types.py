"""Dataclasses at the engine's interface: requests, outputs, load and counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniflow_services.worker.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation request: ``prompt_token_ids`` or, when None, ``prompt`` text.

    ``extra_keys`` maps a page index to its encoded multimodal extra keys
    (``omniflow.kv.blocks.encode_extra_keys``). ``return_logits`` attaches the float32
    logits row each token was sampled from (for correctness tests and debugging).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] | list[int] | None = None
    prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    extra_keys: dict[int, bytes] | None = None
    return_logits: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (a stream item).

    ``finish_reason`` is None while running, else "stop", "length" or "abort".
    ``logits`` is [len(new_token_ids), vocab] when the request asked for it.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    logits: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    free_pages: int
    total_pages: int


@dataclass(slots=True)
class EngineStats:
    """Counters since start; ``connector_failures`` counts fetch/store faults (recomputed)."""

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
