"""The worker's gRPC edge for the audio operations served through ``Invoke``.

``transcribe`` (encoder role, with a Whisper audio encoder): input ``audio`` — the audio
file's bytes (WAV, FLAC, OGG, MP3, ... at any rate), as ``bytes_value``, a ``media`` item
(inline data or a ref) or a ``tensor_ref`` to its bytes — output ``text``. Optional inputs
(OpenAI's transcription fields): ``prompt`` (text), ``temperature`` (0 to 1), ``language``,
``task`` (transcribe or translate), ``timestamps`` (bool), ``seed``; outputs also
``duration`` (seconds), ``language`` and, with timestamps, ``segments`` (a list of structs:
id, seek, start, end, text, tokens, temperature, avg_logprob, compression_ratio,
no_speech_prob).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import numpy as np

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2
from omniflow.errors import InvalidArgument
from omniflow.kv.tensor_client import TensorClient
from omniflow.operations import operation
from omniflow.values import Tokens, VType, from_python, to_python
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.mm import audio_metrics
from omniflow_services.worker.mm.media import AUDIO, MediaInput
from omniflow_services.worker.mm.whisper_decode import TranscribeOptions

# What this edge serves: its entry in the table of operations names the inputs it reads.
TRANSCRIBE = operation("encoder", "transcribe")
assert TRANSCRIBE is not None
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


_PYTHON = {VType.TEXT: str, VType.FLOAT: float, VType.BOOL: bool, VType.INT: int}
# The optional inputs are TranscribeOptions' fields, of the table's kinds.
_OPTIONS = {i.name: _PYTHON[i.kind] for i in TRANSCRIBE.inputs if i.optional}


def _options(inputs: dict[str, common_pb2.Value]) -> TranscribeOptions:
    TRANSCRIBE.check_input_names(inputs)
    given = {}
    for name, kind in _OPTIONS.items():
        if name in inputs:
            value = to_python(inputs[name])
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise InvalidArgument(f"inputs.{name} must be a {kind.__name__}")
            given[name] = value
    return TranscribeOptions(**given)


async def invoke_audio(
    core: WorkerCore,
    request: worker_pb2.InvokeRequest,
    tensors: Callable[[], Awaitable[TensorClient]],
) -> worker_pb2.InvokeResponse:
    """Serve ``encoder.transcribe`` (``TRANSCRIBE``)."""
    enc = core.require_mm("encoder").encoder
    assert enc is not None
    inputs = dict(request.inputs)
    data = await _audio_bytes(inputs, tensors)  # first: a missing audio is named as such
    opts = _options(inputs)
    started = time.perf_counter()
    said = await enc.transcribe(MediaInput(AUDIO, data, "inputs.audio"), opts)
    audio_metrics.record_transcribe(started, said.audio_seconds)
    outputs = {
        "text": common_pb2.Value(text=said.text),
        "duration": common_pb2.Value(float_value=said.audio_seconds),
        "language": common_pb2.Value(text=said.language),
    }
    if opts.timestamps:
        segments = [
            {
                "id": s.id,
                "seek": s.seek,
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": Tokens(s.tokens),
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in said.segments
        ]
        outputs["segments"] = from_python(segments, "segments")
    return worker_pb2.InvokeResponse(outputs=outputs)
