"""``workflow:<name>`` models on /v1/chat/completions (text, or text and audio) and on
/v1/images/generations: one workflow run per answer, through the coordinator.

Audio output is OpenAI's: ``modalities: ["text", "audio"]`` with ``audio: {voice, format}``
answers ``message.audio = {id, data, expires_at, transcript}`` (``content`` null); streamed,
``delta.audio`` pieces carry the transcript as the llm writes and base64 ``pcm16`` as the
talker speaks, then one with only ``expires_at``. Formats: ``wav`` (whole answers, at the
talker's rate) and ``pcm16`` (raw 16-bit mono at 24 kHz; the only one that streams).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omniflow.errors import InvalidArgument
from omniflow.sampling import SamplingError
from omniflow_services.gateway import audio, metrics
from omniflow_services.gateway.core import WORKFLOW_PREFIX, GatewayCore
from omniflow_services.gateway.errors import APIError, bad_request
from omniflow_services.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionAudio,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Delta,
    DeltaAudio,
    ImageData,
    ImageRequest,
    ImagesResponse,
)
from omniflow_services.gateway.replies import DONE, param_model, sse, streaming, usage, whole
from omniflow_services.gateway.types import MediaPart, WorkflowInfo
from omniflow_services.gateway.workflows import (
    Recall,
    answer_output,
    audio_output,
    audio_rate,
    chat_inputs,
    chat_turn,
    heard_key,
    heard_output,
    image_inputs,
    image_outputs,
    no_audio,
    png_of,
    rate_output,
    streamed,
    usage_of,
)

log = logging.getLogger(__name__)

#: How long an answer's audio id stands for its transcript in later turns (``expires_at``).
AUDIO_TTL_S = 3600.0
#: Chat fields a workflow model passes to its answering llm node (``llm_node_params``).
NODE_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")
# Sampling fields that do not apply to a workflow model (its nodes keep their own).
_REFUSED = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logit_bias",
)


@dataclass(slots=True)
class _Turn:
    """One chat run: its inputs, where its text and audio come from, how to send them."""

    name: str
    inputs: dict[str, Any]
    answer: str  # graph output of the text
    answer_node: str
    answer_stream: str  # that node's streamed output ("text")
    audio_out: str | None  # graph output of the audio, when audio is asked for
    audio_node: str
    rate: int  # of the PCM the audio node streams
    fmt: str
    heard: MediaPart | None  # the turn's audio: what the run heard is remembered for it
    info: WorkflowInfo  # what each output carries (the usage, what was heard, the rate)
    audio_stream: str = ""  # the audio node's streamed output ("pcm")
    node_params: dict[str, dict[str, Any]] | None = None  # the request's, per llm node


class WorkflowAPI:
    """Chat and image requests for workflow models."""

    def __init__(self, core: GatewayCore, max_n: int, audio_ttl_s: float = AUDIO_TTL_S) -> None:
        self.core, self.max_n = core, max_n
        self.audio_ttl_s = audio_ttl_s
        self.recall = Recall(audio_ttl_s)

    # ------------------------------------------------------------ chat

    async def chat(
        self, request: Request, req: ChatCompletionRequest, rid: str, messages: list[dict[str, Any]]
    ) -> Response:
        name = req.model.removeprefix(WORKFLOW_PREFIX)
        for field in _REFUSED:
            if field in req.model_fields_set and getattr(req, field) != _DEFAULTS[field]:
                raise bad_request(
                    f"{field} does not apply to a workflow model (it takes "
                    f"{', '.join(NODE_FIELDS)}, for its answering llm node)",
                    field,
                )
        if req.n != 1 or req.logprobs or req.presence_penalty or req.frequency_penalty:
            raise bad_request("n, logprobs and penalties do not apply to a workflow model", "n")
        fmt = _audio_format(req)
        info = await param_model(self.core.workflow_info(name))
        turn = await param_model(self._turn(name, info, messages, fmt))
        turn.node_params = llm_node_params(name, info, turn.answer_node, req)
        created = int(time.time())
        if req.stream:
            return streaming(self._events(turn, req, rid, created, request.state.arrived))
        result = await whole(request, self._whole(turn, req, rid, created, request.state.arrived))
        return Response(status_code=499) if result is None else JSONResponse(result.model_dump())

    async def _turn(
        self, name: str, info: WorkflowInfo, messages: list[dict[str, Any]], fmt: str | None
    ) -> _Turn:
        said = chat_turn(messages, self.recall)
        inputs = chat_inputs(info, said)
        audio_out = audio_output(info) if fmt else None
        if fmt and audio_out is None:
            raise bad_request(no_audio(info) + ': ask for modalities ["text"]', "modalities")
        answer = answer_output(info, audio_out)
        audio_node = info.outputs.get(audio_out, "") if audio_out else ""
        return _Turn(
            name,
            inputs,
            answer,
            info.outputs.get(answer, ""),
            info.sources.get(answer) or "text",
            audio_out,
            audio_node,
            audio_rate(info, audio_out) if audio_out else 0,
            fmt or "",
            said.audio,
            info,
            streamed(info, audio_node) if audio_node else "",
        )

    async def _run(self, turn: _Turn) -> AsyncIterator[tuple[str, str | bytes | dict[str, Any]]]:
        """("text", delta), ("pcm", chunk) as the run streams them, then ("outputs", ...)."""
        run = self.core.run_workflow(turn.name, turn.inputs, turn.node_params)
        async with aclosing(run) as runs:
            async for c in runs:
                if c.outputs is not None:
                    if c.error:
                        raise APIError(
                            500, f"workflow {turn.name!r} failed: {c.error}", "server_error"
                        )
                    self._remember_heard(turn, c.outputs)
                    yield "outputs", c.outputs
                    return
                if c.node != turn.answer_node and c.node != turn.audio_node:
                    continue
                if c.text and c.node == turn.answer_node and c.output == turn.answer_stream:
                    yield "text", c.text
                elif c.data and turn.audio_stream and c.node == turn.audio_node:
                    if c.output == turn.audio_stream:
                        yield "pcm", c.data
        raise APIError(500, f"workflow {turn.name!r} ended without a result", "server_error")

    def _remember_heard(self, turn: _Turn, outputs: dict[str, Any]) -> None:
        out = heard_output(turn.info)
        heard = outputs.get(out) if out else None
        if turn.heard is not None and isinstance(heard, str) and heard:
            self.recall.put(heard_key(turn.heard.data), heard)

    async def _whole(
        self, turn: _Turn, req: ChatCompletionRequest, rid: str, created: int, arrived: float
    ) -> ChatCompletion:
        outputs: dict[str, Any] = {}
        async with aclosing(self._run(turn)) as run:
            async for kind, value in run:
                if kind == "outputs":
                    assert isinstance(value, dict)
                    outputs = value
        text = _text(outputs, turn.answer)
        message = AssistantMessage(content=text)
        if turn.audio_out:
            data = self._audio_of(turn, outputs)
            metrics.AUDIO_SECONDS.labels("chat").inc(_seconds(data, turn.fmt))
            aid = _audio_id()
            self.recall.put(f"audio:{aid}", text)
            message = AssistantMessage(
                content=None,
                audio=ChatCompletionAudio(
                    id=aid,
                    data=base64.b64encode(data).decode(),
                    expires_at=int(time.time() + self.audio_ttl_s),
                    transcript=text,
                ),
            )
        metrics.E2E.labels("chat").observe(time.perf_counter() - arrived)
        choice = ChatChoice(index=0, message=message, finish_reason="stop")
        return ChatCompletion(
            id=rid,
            created=created,
            model=req.model,
            choices=[choice],
            usage=usage(*usage_of(turn.info, outputs)),
        )

    def _audio_of(self, turn: _Turn, outputs: dict[str, Any]) -> bytes:
        assert turn.audio_out is not None
        value = outputs.get(turn.audio_out)
        if not isinstance(value, bytes) or not value:
            raise APIError(
                500,
                f"workflow {turn.name!r} gave no audio (output {turn.audio_out!r} is "
                f"{type(value).__name__})",
                "server_error",
            )
        rate = _rate(turn, outputs)
        return audio.encode(
            value, rate if isinstance(rate, int) and rate > 0 else turn.rate, turn.fmt
        )

    async def _events(
        self, turn: _Turn, req: ChatCompletionRequest, rid: str, created: int, arrived: float
    ) -> AsyncIterator[bytes]:
        def chunk(delta: Delta, finish: str | None = None) -> bytes:
            choice = ChunkChoice(index=0, delta=delta, finish_reason=finish)
            return sse(
                ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[choice])
            )

        spoken = turn.audio_out is not None
        aid = _audio_id() if spoken else ""

        def said(text: str) -> Delta:
            return (
                Delta(audio=DeltaAudio(id=aid, transcript=text)) if spoken else Delta(content=text)
            )

        def sound(pcm: bytes) -> Delta:
            return Delta(audio=DeltaAudio(id=aid, data=base64.b64encode(pcm).decode()))

        yield chunk(Delta(role="assistant") if spoken else Delta(role="assistant", content=""))
        # PCM comes only from the audio node, so only a spoken answer resamples.
        resample = audio.PcmResampler(turn.rate or audio.PCM16_RATE, audio.PCM16_RATE)
        parts: list[str] = []
        sent_pcm = 0
        outputs: dict[str, Any] = {}
        async with aclosing(self._run(turn)) as run:
            async for kind, value in run:
                if kind == "text":
                    assert isinstance(value, str)
                    parts.append(value)
                    yield chunk(said(value))
                elif kind == "pcm":
                    assert isinstance(value, bytes)
                    pcm = resample(value)
                    if pcm:
                        if not sent_pcm:
                            metrics.FIRST_AUDIO.labels("chat").observe(
                                time.perf_counter() - arrived
                            )
                        sent_pcm += len(pcm)
                        yield chunk(sound(pcm))
                else:
                    assert isinstance(value, dict)
                    outputs = value
        text = "".join(parts)
        if not parts:  # the answer did not stream (e.g. it comes out of a branch)
            text = _text(outputs, turn.answer)
            if text:
                yield chunk(said(text))
        if spoken:
            tail = resample(b"", last=True) if sent_pcm else self._audio_of(turn, outputs)
            if tail:
                sent_pcm += len(tail)
                yield chunk(sound(tail))
            rate = _rate(turn, outputs)
            if sent_pcm and isinstance(rate, int) and rate and rate != turn.rate:
                log.warning(
                    "workflow %s streamed PCM at %d Hz, not the %d Hz its talker node implies",
                    turn.name,
                    rate,
                    turn.rate,
                )
            metrics.AUDIO_SECONDS.labels("chat").inc(sent_pcm / 2 / audio.PCM16_RATE)
            self.recall.put(f"audio:{aid}", text)
            expires = int(time.time() + self.audio_ttl_s)
            yield chunk(Delta(audio=DeltaAudio(id=aid, expires_at=expires)))
        metrics.E2E.labels("chat").observe(time.perf_counter() - arrived)
        yield chunk(Delta(), "stop")
        if req.stream_options and req.stream_options.include_usage:
            yield sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=req.model,
                    choices=[],
                    usage=usage(*usage_of(turn.info, outputs)),
                )
            )
        yield DONE

    # ------------------------------------------------------------ images

    async def images(
        self, request: Request, req: ImageRequest, size: tuple[int, int] | None
    ) -> Response:
        """``n`` runs of an image workflow (at once): PNGs and the prompts they drew."""
        name = req.model.removeprefix(WORKFLOW_PREFIX)
        info = await param_model(self.core.workflow_info(name))
        image_out, revised = image_outputs(info)
        try:
            image_inputs(info, req.prompt, size, req.seed)  # a bad request fails before any run
        except InvalidArgument as exc:
            raise bad_request(str(exc), _param_of(str(exc))) from None

        async def one(i: int) -> ImageData:
            seed = None if req.seed is None else (req.seed + i) % 2**63
            outputs: dict[str, Any] = {}
            inputs = image_inputs(info, req.prompt, size, seed)
            async with aclosing(self.core.run_workflow(name, inputs)) as runs:
                async for c in runs:
                    if c.outputs is None:
                        continue
                    if c.error:
                        raise APIError(500, f"workflow {name!r} failed: {c.error}", "server_error")
                    outputs = c.outputs
            drawn = outputs.get(revised) if revised else None
            return ImageData(
                b64_json=base64.b64encode(png_of(outputs.get(image_out), image_out)).decode(),
                revised_prompt=drawn if isinstance(drawn, str) else None,
            )

        work = asyncio.gather(*(param_model(one(i)) for i in range(req.n)))
        images = await whole(request, work)
        if images is None:
            return Response(status_code=499)
        return JSONResponse(ImagesResponse(created=int(time.time()), data=images).model_dump())


_DEFAULTS = {f: ChatCompletionRequest.model_fields[f].default for f in _REFUSED}


def llm_node_params(
    name: str, info: WorkflowInfo, answer_node: str, req: ChatCompletionRequest
) -> dict[str, dict[str, Any]] | None:
    """The request's ``NODE_FIELDS`` as params of the llm node that writes the answer (a
    top-level ``llm`` ``generate`` node), or of every top-level llm generate node when
    another kind of node answers; over the nodes' own params for this run. Values are
    checked by the sampling contract first (a 400 naming the field)."""
    asked = [f for f in NODE_FIELDS if getattr(req, f) is not None]
    if req.max_completion_tokens is not None:
        asked.append("max_completion_tokens")
    if not asked:
        return None
    try:
        sampling = req.to_sampling_params()
    except SamplingError as exc:
        raise bad_request(str(exc), exc.field) from None
    params: dict[str, Any] = {f: getattr(sampling, f) for f in NODE_FIELDS if f in asked}
    if "max_completion_tokens" in asked:  # it wins over max_tokens, as for models
        params["max_tokens"] = sampling.max_tokens
    if "stop" in params:
        params["stop"] = list(params["stop"])
    llm = {
        n: node
        for n, node in info.nodes.items()
        if node.role == "llm" and node.operation == "generate"
        and not node.params.get("prefill_only")
    }  # fmt: skip
    targets = [answer_node] if answer_node in llm else sorted(llm)
    if not targets:
        field = asked[0]
        raise bad_request(
            f"{field}: workflow {name!r} has no top-level llm generate node to apply it to",
            field,
        )
    return {n: params for n in targets}


def _audio_format(req: ChatCompletionRequest) -> str | None:
    """The audio format asked for (None: a text answer); a 400 naming the param otherwise."""
    wants = "audio" in (req.modalities or [])
    if req.audio is None:
        if wants:
            raise bad_request(
                "modalities includes 'audio' but audio is not set: send audio: "
                "{voice, format} (format wav or pcm16)",
                "audio",
            )
        return None
    if not wants:
        raise bad_request(
            "audio is set but modalities does not include 'audio': send "
            'modalities: ["text", "audio"]',
            "modalities",
        )
    fmt = req.audio.format
    if fmt not in audio.CHAT_FORMATS:
        raise bad_request(
            f"audio.format {fmt!r} is not served; accepted: {', '.join(audio.CHAT_FORMATS)}",
            "audio.format",
        )
    if req.stream and fmt != "pcm16":
        raise bad_request(
            f"audio.format {fmt!r} does not stream; with stream: true send 'pcm16' (raw "
            "16-bit mono at 24 kHz, as OpenAI's)",
            "audio.format",
        )
    try:
        audio.check_chat_voice(req.audio.voice)
    except InvalidArgument as exc:
        raise bad_request(str(exc), "audio.voice") from None
    return fmt


def _param_of(message: str) -> str | None:
    for param in ("size", "seed"):
        if message.startswith(param + ":"):
            return param
    return None


def _text(outputs: dict[str, Any], name: str) -> str:
    value = outputs.get(name, "")
    return value if isinstance(value, str) else str(value)


def _rate(turn: _Turn, outputs: dict[str, Any]) -> Any:
    """The talker's rate a run gave (its output carrying ``sample_rate``), else None."""
    out = rate_output(turn.info, turn.audio_out) if turn.audio_out else None
    return outputs.get(out) if out else None


def _audio_id() -> str:
    return "audio_" + secrets.token_hex(16)


def _seconds(data: bytes, fmt: str) -> float:
    if fmt == "pcm16":
        return len(data) / 2 / audio.PCM16_RATE
    pcm, rate = audio.pcm_of(data, audio.PCM16_RATE)
    return len(pcm) / 2 / rate
