"""Finish reasons: the one table between the engines' names and the worker API's enum.

Engines (built-in, vLLM, SGLang) end a request with "stop", "length" or "abort" (a worker
may also report "error"); the worker API carries them as ``worker.v1.FinishReason``; the
gateway and the coordinator turn the enum back into the names (OpenAI's words).
"""

from __future__ import annotations

from omniflow.api.worker.v1 import worker_pb2

#: Name -> enum value. Anything else is FINISH_REASON_UNSPECIFIED (0).
FINISH_TO_PROTO: dict[str, int] = {
    "stop": worker_pb2.FINISH_REASON_STOP,
    "length": worker_pb2.FINISH_REASON_LENGTH,
    "abort": worker_pb2.FINISH_REASON_ABORT,
    "error": worker_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO: dict[int, str] = {v: k for k, v in FINISH_TO_PROTO.items()}

#: What an engine may report for a finished request.
ENGINE_REASONS = ("stop", "length", "abort")


def finish_to_proto(reason: str | None) -> int:
    """The enum value of ``reason`` (0 for None or an unknown name)."""
    return FINISH_TO_PROTO.get(reason or "", worker_pb2.FINISH_REASON_UNSPECIFIED)


def finish_from_proto(value: int, default: str = "") -> str:
    """The name of an enum value (``default`` for 0 or an unknown value)."""
    return FINISH_FROM_PROTO.get(value, default)


def engine_finish(reason: object) -> str:
    """A backend's own finish reason (vLLM's, SGLang's ``type``) as one of ours: its name
    when it is one of ``ENGINE_REASONS``, else "stop" (e.g. a matched stop string)."""
    name = str(reason)
    return name if name in ENGINE_REASONS else "stop"
