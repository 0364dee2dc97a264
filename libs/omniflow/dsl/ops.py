"""Signatures of operations: the built-in roles' and those a user registers.

The DSL checks node inputs and outputs against these when it builds a graph; the
compiled graph carries the ports, so the coordinator validates without this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniflow.errors import InvalidArgument
from omniflow.values import VType
from omniflow.workers import ROLES


@dataclass(frozen=True, slots=True)
class OpSignature:
    """Typed inputs and outputs of one operation of a role.

    ``streams`` names the output whose partial values a Call streams (``text`` deltas of
    ``llm.generate``, ``pcm`` chunks of ``talker.synthesize``); empty when unary.
    ``phrased``: inputs that a streaming edge feeds whole phrases (sentences, at most
    ``PHRASE_INPUT_CHARS``) even when it asks for no phrase length: a prompt cut at every
    token would be one call per token, each on a word or two (``Ref.stream``).
    """

    role: str
    operation: str
    inputs: dict[str, VType]
    outputs: dict[str, VType]
    optional: frozenset[str] = field(default_factory=frozenset)
    streams: str = ""
    phrased: frozenset[str] = field(default_factory=frozenset)


#: The longest phrase a ``phrased`` input gets from a ``.stream()`` edge with no length.
PHRASE_INPUT_CHARS = 400

BUILTIN: dict[tuple[str, str], OpSignature] = {
    ("llm", "generate"): OpSignature(
        "llm",
        "generate",
        # messages: the chat so far; media: an encoder's items (coordinator/conversation.py)
        {"prompt": VType.TEXT, "session": VType.TEXT, "messages": VType.LIST, "media": VType.LIST},
        {
            "text": VType.TEXT,
            "prompt_tokens": VType.INT,
            "cached_tokens": VType.INT,
            "completion_tokens": VType.INT,
            "finish_reason": VType.TEXT,
            # With param prefill_only: the prompt's stored pages, for another role to pull
            # ({kv_namespace, block_hashes, token_ids, node}; generate_image input ``pages``).
            "pages": VType.STRUCT,
        },
        optional=frozenset({"session", "messages", "media"}),
        streams="text",
        phrased=frozenset({"prompt"}),
    ),
    # media: media items; image, audio: a file's bytes (at least one of the three)
    ("encoder", "encode"): OpSignature(
        "encoder",
        "encode",
        {"media": VType.ANY, "image": VType.ANY, "audio": VType.ANY},
        {"items": VType.LIST, "cache_hits": VType.INT},
        optional=frozenset({"media", "image", "audio"}),
    ),
    # Served through Invoke by an encoder worker with a Whisper model: audio file bytes in.
    # Optional: OpenAI's transcription fields; segments with timestamps: true.
    ("encoder", "transcribe"): OpSignature(
        "encoder",
        "transcribe",
        {
            "audio": VType.ANY,
            "prompt": VType.TEXT,
            "temperature": VType.FLOAT,
            "language": VType.TEXT,
            "task": VType.TEXT,
            "timestamps": VType.BOOL,
            "seed": VType.INT,
        },
        {
            "text": VType.TEXT,
            "duration": VType.FLOAT,
            "language": VType.TEXT,
            "segments": VType.LIST,
        },
        optional=frozenset({"prompt", "temperature", "language", "task", "timestamps", "seed"}),
    ),
    # Served through Invoke by an embed worker: texts or token id lists in, vectors out
    # (float32 little-endian bytes, count x dim).
    ("embed", "embed"): OpSignature(
        "embed",
        "embed",
        {"texts": VType.LIST, "token_ids": VType.LIST, "dimensions": VType.INT},
        {
            "embeddings": VType.BYTES,
            "dim": VType.INT,
            "count": VType.INT,
            "prompt_tokens": VType.INT,
        },
        optional=frozenset({"texts", "token_ids", "dimensions"}),
    ),
    ("diffusion", "generate_image"): OpSignature(
        "diffusion",
        "generate_image",
        # One of prompt (text, prefilled here) or pages (an llm's prefill_only pages, pulled);
        # width/height/steps/seed inputs override the node's params of the same name.
        {
            "prompt": VType.TEXT,
            "pages": VType.STRUCT,
            "width": VType.INT,
            "height": VType.INT,
            "steps": VType.INT,
            "seed": VType.INT,
        },
        {
            "image": VType.ANY,
            "width": VType.INT,
            "height": VType.INT,
            "prompt_tokens": VType.INT,
            "cached_prompt_tokens": VType.INT,
        },
        optional=frozenset({"prompt", "pages", "width", "height", "steps", "seed"}),
    ),
    ("talker", "synthesize"): OpSignature(
        "talker",
        "synthesize",
        {"text": VType.TEXT},
        {"pcm": VType.BYTES, "wav": VType.BYTES, "sample_rate": VType.INT},
        streams="pcm",
    ),
}

BUILTIN_ROLES = frozenset(ROLES)

_USER: dict[tuple[str, str], OpSignature] = {}


def register_operation(
    role: str,
    operation: str,
    inputs: dict[str, VType],
    outputs: dict[str, VType],
    *,
    optional: tuple[str, ...] = (),
    streams: str = "",
) -> OpSignature:
    """Declare an operation a worker serves through ``Invoke`` so that graphs can call it."""
    if (role, operation) in BUILTIN:
        raise InvalidArgument(f"{role}.{operation} is built in and cannot be redefined")
    sig = OpSignature(role, operation, dict(inputs), dict(outputs), frozenset(optional), streams)
    _USER[(role, operation)] = sig
    return sig


def signature(role: str, operation: str) -> OpSignature:
    """The signature of ``role.operation``; raises InvalidArgument naming what is known."""
    sig = BUILTIN.get((role, operation)) or _USER.get((role, operation))
    if sig is not None:
        return sig
    known = sorted({f"{r}.{o}" for r, o in (*BUILTIN, *_USER) if r == role})
    if known:
        raise InvalidArgument(
            f"unknown operation {operation!r} of role {role!r}; known: {', '.join(known)}"
        )
    roles = sorted({r for r, _ in (*BUILTIN, *_USER)})
    raise InvalidArgument(
        f"unknown role {role!r}; known: {', '.join(roles)} "
        "(declare a user operation with omniflow.dsl.register_operation)"
    )
