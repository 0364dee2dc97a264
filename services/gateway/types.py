"""The gateway's domain types: what its core, its HTTP layer and its gRPC side
(``backends.py``) pass between them. Plain data only; no protobuf, gRPC or HTTP here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniflow.dsl.flow import OutputFlow
from omniflow.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class MediaPart:
    data: bytes
    mime_type: str


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One Generate: token ids (text) or chat messages with media parts (multimodal)."""

    request_id: str
    sampling: SamplingParams
    token_ids: list[int] | None = None
    messages: list[tuple[str, list[str | MediaPart]]] | None = None


@dataclass(slots=True)
class GenChunk:
    """One streamed piece of a generation; ``finish_reason`` and usage on the last."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Picked:
    worker_id: str
    address: str
    #: The pick's count of this call on the worker (``Backends.report`` ends it).
    ticket: int | None = None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A top-level call node of a workflow: what it calls and its static params."""

    role: str
    operation: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class WorkflowInfo:
    name: str
    inputs: tuple[tuple[str, int, bool], ...]  # (name, value type, optional)
    outputs: dict[str, str]  # graph output -> producing node ("" when not a node output)
    #: graph output -> the producing node's output name ("" when not a node output)
    sources: dict[str, str] = field(default_factory=dict)
    output_types: dict[str, int] = field(default_factory=dict)  # graph output -> value type
    nodes: dict[str, NodeInfo] = field(default_factory=dict)  # top-level call nodes
    #: graph input -> the chat parts it takes: those of the call inputs it reaches in the
    #: table of operations (``omniflow.dsl.flow.chat_parts``)
    takes: dict[str, frozenset[str]] = field(default_factory=dict)
    #: graph output -> what it carries: the answer parts of the call outputs it holds in the
    #: table of operations (``omniflow.dsl.flow.output_flow``)
    carries: dict[str, OutputFlow] = field(default_factory=dict)


@dataclass(slots=True)
class RunChunk:
    """A workflow's streamed text or bytes (``node``/``output``), or its end (``outputs``)."""

    node: str = ""
    output: str = ""
    text: str = ""
    data: bytes = b""
    outputs: dict[str, Any] | None = None
    error: str = ""
