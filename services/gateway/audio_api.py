"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: speech → text through
an encoder worker's Whisper (its ``transcribe`` operation, served through ``Invoke``).

The body is multipart/form-data, as the ``openai`` client uploads it: ``file`` (any common
audio file: WAV, FLAC, OGG, MP3...), ``model`` and OpenAI's optional fields. ``model`` is the
Whisper model's name (``whisper-tiny.en``, as ``GET /v1/models`` lists it) or
``whisper-1``, OpenAI's name, which any transcribing encoder answers. ``response_format``:
``json`` (``{"text"}``), ``text``, ``verbose_json`` (segments with timestamps), ``srt``,
``vtt``; the last three decode with Whisper's timestamp tokens. A translation is speech in
any language the model hears, English text out: an English-only model (tiny.en) hears
English only, so its translation is its transcription.
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from omniflow.errors import NotFound
from omniflow.workers import WorkerRecord
from omniflow_services.gateway import metrics
from omniflow_services.gateway.core import GatewayCore, transcribe_name
from omniflow_services.gateway.endpoint_shapes import (
    DurationUsage,
    Transcription,
    TranscriptionRequest,
    TranscriptionSegment,
    TranscriptionVerbose,
    TranslationRequest,
)
from omniflow_services.gateway.errors import APIError, bad_request, from_validation
from omniflow_services.gateway.replies import param_model, whole

OPENAI_NAME = "whisper-1"  # what OpenAI clients send; any Whisper here answers it
LANGUAGE_NAMES = {"en": "english"}  # verbose_json names the language as OpenAI does
TIMED = ("verbose_json", "srt", "vtt")


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[dict[str, Any]]) -> str:
    """SubRip subtitles: numbered cues, ``HH:MM:SS,mmm`` times."""
    cues = [
        f"{i}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text'].strip()}\n"
        for i, s in enumerate(segments, 1)
    ]
    return "\n".join(cues)


def vtt(segments: list[dict[str, Any]]) -> str:
    """WebVTT subtitles: the header, then cues with ``HH:MM:SS.mmm`` times."""
    cues = [
        f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n"
        for s in segments
    ]
    return "WEBVTT\n\n" + "\n".join(cues)


async def _form(request: Request, cls: type[BaseModel]) -> Any:
    """The multipart form as ``cls``; a 400 naming the field that is wrong or missing."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request(
            "send the audio as multipart/form-data (fields file, model, ...), as the "
            "openai client does",
            "file",
        )
    try:
        form = await request.form(max_files=1, max_fields=32)
    except Exception as exc:  # a malformed body: python-multipart's or Starlette's errors
        raise bad_request(f"the multipart body cannot be read: {exc}") from None
    fields: dict[str, Any] = {}
    try:
        for key, value in form.multi_items():
            if key == "file" and not isinstance(value, UploadFile):
                raise bad_request(
                    "file must be an uploaded file (a form part with a filename)", "file"
                )
            if isinstance(value, UploadFile):
                value = await value.read()
            if key.endswith("[]"):
                fields.setdefault(key, []).append(value)
            elif key in fields:
                raise bad_request(f"{key} is given twice", key)
            else:
                fields[key] = value
    finally:
        await form.close()
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise from_validation(exc) from None


class AudioRoutes:
    """The handlers of the two audio-to-text routes."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def _workers(self, model: str) -> list[WorkerRecord]:
        everyone = [
            w
            for w in await self.core.backends.workers()
            if w.role == "encoder" and "transcribe" in w.operations
        ]
        mine = [w for w in everyone if model in (OPENAI_NAME, transcribe_name(w))]
        if not mine:
            names = sorted({transcribe_name(w) for w in everyone})
            raise NotFound(
                f"model {model!r} does not transcribe here; served: "
                f"{', '.join([OPENAI_NAME, *names]) if names else 'none'} "
                "(GET /v1/models lists them)"
            )
        return mine

    async def transcriptions(self, request: Request) -> Response:
        req: TranscriptionRequest = await _form(request, TranscriptionRequest)
        if req.stream:
            raise bad_request("stream is not supported by Whisper models; leave it unset", "stream")
        grains = req.timestamp_granularities or []
        if grains and req.response_format != "verbose_json":
            raise bad_request(
                "timestamp_granularities needs response_format verbose_json",
                "timestamp_granularities",
            )
        if "word" in grains:
            raise bad_request(
                "word timestamps are not served; accepted timestamp_granularities: segment",
                "timestamp_granularities",
            )
        options = {"language": (req.language or "").strip().lower()} if req.language else {}
        return await self._run(request, req, "transcribe", options)

    async def translations(self, request: Request) -> Response:
        req: TranslationRequest = await _form(request, TranslationRequest)
        return await self._run(request, req, "translate", {})

    async def _run(
        self,
        request: Request,
        req: TranscriptionRequest | TranslationRequest,
        task: str,
        options: dict[str, Any],
    ) -> Response:
        if not req.file:
            raise bad_request("file is empty: upload an audio file", "file")
        timed = req.response_format in TIMED
        inputs: dict[str, Any] = {
            "audio": req.file,
            "task": task,
            "temperature": float(req.temperature),
            "timestamps": timed,
            **options,
        }
        if req.prompt:
            inputs["prompt"] = req.prompt
        arrived = request.state.arrived
        workers = await param_model(self._workers(req.model))
        call = self.core.invoke(req.model, "encoder", "transcribe", inputs, workers)
        try:
            out = await whole(request, param_model(call))
        except APIError as err:  # the worker names its input; the client sent it as `file`
            if err.status == 400 and "inputs.audio" in err.message:
                err.message, err.param = err.message.replace("inputs.audio", "file"), "file"
            raise
        if out is None:
            return Response(status_code=499)
        duration = float(out.get("duration", 0.0))
        route = "transcriptions" if task == "transcribe" else "translations"
        metrics.AUDIO_INPUT_SECONDS.labels(route).inc(duration)
        metrics.E2E.labels(route).observe(time.perf_counter() - arrived)
        text = str(out["text"])
        usage = DurationUsage(seconds=math.ceil(duration))
        segments: list[dict[str, Any]] = [dict(s) for s in out.get("segments") or []]
        fmt = req.response_format
        if fmt == "text":
            return PlainTextResponse(text + "\n")
        if fmt == "srt":
            return PlainTextResponse(srt(segments))
        if fmt == "vtt":
            return PlainTextResponse(vtt(segments), media_type="text/vtt")
        if fmt == "json":
            return JSONResponse(Transcription(text=text, usage=usage).model_dump())
        lang = str(out.get("language") or "en")
        body = TranscriptionVerbose(
            task=task,  # type: ignore[arg-type]
            language=LANGUAGE_NAMES.get(lang, lang),
            duration=round(duration, 3),
            text=text,
            segments=[TranscriptionSegment(**{**s, "tokens": list(s["tokens"])}) for s in segments],
            usage=usage,
        )
        return JSONResponse(body.model_dump())
