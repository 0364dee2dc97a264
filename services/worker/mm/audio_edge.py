"""The worker's gRPC edge for the audio operations served through ``Invoke``.

``transcribe`` (encoder role, with a Whisper audio encoder): input ``audio`` — the audio
file's bytes (WAV, FLAC, OGG, MP3, ... at any rate), as ``bytes_value``, a ``media`` item
(inline data or a ref) or a ``tensor_ref`` to its bytes — output ``text``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import numpy as np

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2
from omniflow.errors import InvalidArgument
from omniflow.kv.tensor_client import TensorClient
from omniflow.workers import MODEL_OPERATIONS
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.mm import audio_metrics
from omniflow_services.worker.mm.media import AUDIO, MediaInput

# The encoder's Invoke operations (the one table of roles): what this edge serves.
AUDIO_OPERATIONS = MODEL_OPERATIONS["encoder"]
_ACCEPTED = "the audio file's bytes (bytes_value, a media item or a tensor_ref)"


async def _audio_bytes(
    inputs: dict[str, common_pb2.Value], tensors: Callable[[], Awaitable[TensorClient]]
) -> bytes:
    if "audio" not in inputs:
        known = ", ".join(sorted(inputs)) or "none"
        raise InvalidArgument(f"inputs.audio is missing (inputs given: {known}); send {_ACCEPTED}")
    value = inputs["audio"]
    kind = value.WhichOneof("kind")
    if kind == "bytes_value":
        return value.bytes_value
    ref: common_pb2.TensorRef | None = None
    if kind == "media":
        if value.media.WhichOneof("source") != "ref":
            return value.media.data
        ref = value.media.ref
    elif kind == "tensor_ref":
        ref = value.tensor_ref
    if ref is None:
        raise InvalidArgument(f"inputs.audio is a {kind or 'empty value'}; send {_ACCEPTED}")
    raw = await (await tensors()).get(ref)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8).tobytes()


async def invoke_audio(
    core: WorkerCore,
    request: worker_pb2.InvokeRequest,
    tensors: Callable[[], Awaitable[TensorClient]],
) -> worker_pb2.InvokeResponse:
    """Serve ``request.operation`` (one of ``AUDIO_OPERATIONS``)."""
    enc = core.require_mm("encoder").encoder
    assert enc is not None
    data = await _audio_bytes(dict(request.inputs), tensors)
    started = time.perf_counter()
    said = await enc.transcribe(MediaInput(AUDIO, data, "inputs.audio"))
    audio_metrics.record_transcribe(started, said.audio_seconds)
    return worker_pb2.InvokeResponse(outputs={"text": common_pb2.Value(text=said.text)})
