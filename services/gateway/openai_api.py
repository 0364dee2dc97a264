"""The OpenAI endpoints: request bodies to core calls, core streams to OpenAI objects
(whole, or as server-sent events ending in ``data: [DONE]``).

A client that disconnects ends its worker calls: a streamed response's generator is
cancelled by Starlette, a whole one races the work against the disconnect.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omniflow.chat.tools import tool_format_for
from omniflow.sampling import SamplingError, SamplingParams, StructuredOutput
from omniflow_services.gateway import audio, metrics
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.core import WORKFLOW_PREFIX, GatewayCore, Prepared
from omniflow_services.gateway.errors import APIError, bad_request, parse_json
from omniflow_services.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ImageData,
    ImageRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    SpeechRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from omniflow_services.gateway.replies import (
    DONE,
    joined,
    param_model,
    sse,
    streaming,
    usage,
    whole,
)
from omniflow_services.gateway.structured import Constraint, constraint_of, naming, primed
from omniflow_services.gateway.tool_calls import (
    StreamedCalls,
    ToolPlan,
    one_constraint,
    plan_tools,
    refuse_on_workflow,
    template_options,
    whole_answer,
)
from omniflow_services.gateway.types import GenChunk
from omniflow_services.gateway.workflow_api import WorkflowAPI

MAX_IMAGE_SIDE = 2048


@dataclass(frozen=True, slots=True)
class _Chat:
    """One chat request as its answer, whole or streamed, needs it."""

    prep: Prepared
    req: ChatCompletionRequest
    rid: str
    created: int
    arrived: float
    plan: ToolPlan | None


class Tally:
    """Per-choice accounting while choices stream: finish reasons and token counts."""

    def __init__(self, route: str, arrived: float) -> None:
        self.route, self.arrived = route, arrived
        self.finish: dict[int, str] = {}
        self.prompt = self.cached = self.completion = 0
        self.last: dict[int, float] = {}

    def saw(self, index: int, chunk: GenChunk) -> None:
        now = time.perf_counter()
        before = self.last.get(index)
        if before is None:
            metrics.TTFT.labels(self.route).observe(now - self.arrived)
        else:
            metrics.ITL.labels(self.route).observe(now - before)
        self.last[index] = now
        if chunk.finish_reason:
            if chunk.finish_reason in ("abort", "error"):
                raise APIError(500, "the worker ended the request early", "server_error")
            self.finish[index] = chunk.finish_reason
            self.completion += chunk.completion_tokens
            if index == 0 or not self.prompt:  # the prompt counts once, whatever n is
                self.prompt, self.cached = chunk.prompt_tokens, chunk.cached_tokens

    def done(self, prompts: int = 1) -> Usage:
        m = self.route
        metrics.PROMPT_TOKENS.labels(m).inc(self.prompt * prompts)
        metrics.CACHED_TOKENS.labels(m).inc(self.cached)
        metrics.COMPLETION_TOKENS.labels(m).inc(self.completion)
        metrics.E2E.labels(m).observe(time.perf_counter() - self.arrived)
        return usage(self.prompt, self.cached, self.completion)


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    max_n: int,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """The request's sampling contract; a 400 naming the field for a value out of range."""
    if req.n > max_n:
        raise bad_request(f"n={req.n} is above this server's limit {max_n}", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    try:
        return req.to_sampling_params(structured)
    except SamplingError as exc:
        name = exc.field
        if name == "max_tokens" and getattr(req, "max_completion_tokens", None):
            name = "max_completion_tokens"
        raise bad_request(str(exc), name) from None


class OpenAIRoutes:
    """Handlers of the /v1 routes."""

    def __init__(self, settings: GatewaySettings, core: GatewayCore) -> None:
        self.settings = settings
        self.core = core
        self.workflows = WorkflowAPI(core, settings.max_n)

    # ------------------------------------------------------------ helpers

    async def _stream(
        self,
        events: AsyncIterator[bytes],
        preps: list[Prepared],
        n: int = 1,
        constraint: Constraint | None = None,
    ) -> StreamingResponse:
        """SSE of ``events``; the workers of ``preps`` are picked before the 200 is sent
        (picks no stream used are released at the end). With a constraint, the stream's
        first event (its first worker chunk) is awaited first: a grammar the worker
        cannot compile is a 400 naming the field."""
        for prep in preps:
            await param_model(self.core.prepick(prep, n))
        if constraint is not None:
            try:
                events = await primed(events, 1, constraint)
            except BaseException:
                self.core.release(preps)
                raise
        return streaming(events, lambda: self.core.release(preps))

    # ------------------------------------------------------------ models

    async def models(self) -> Response:
        now = int(time.time())
        cards = [ModelCard(id=m, created=now, owned_by=o) for m, o in await self.core.models()]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def model(self, model_id: str) -> Response:
        now = int(time.time())
        for m, o in await self.core.models():
            if m == model_id:
                return JSONResponse(ModelCard(id=m, created=now, owned_by=o).model_dump())
        raise APIError(
            404, f"model {model_id!r} does not exist", param="model", code="model_not_found"
        )

    # ------------------------------------------------------------ chat

    async def chat(self, request: Request) -> Response:
        req = await parse_json(request, ChatCompletionRequest)
        arrived = request.state.arrived
        rid = "chatcmpl-" + request.state.request_id.removeprefix("req-")
        messages = [_message(m) for m in req.messages]
        if req.model.startswith(WORKFLOW_PREFIX):
            refuse_on_workflow(req)
            return await self.workflows.chat(request, req, rid, messages)
        if (req.modalities and "audio" in req.modalities) or req.audio is not None:
            raise bad_request(
                f"audio output is spoken by workflow models with a talker (such as "
                f"{WORKFLOW_PREFIX}omni_chat, GET /v1/models lists them); {req.model!r} answers "
                "text only",
                "modalities",
            )
        for i, m in enumerate(messages):
            if m["content"] is None and not m.get("tool_calls"):
                raise bad_request(
                    f"messages[{i}].content is missing: an llm model reads text (an assistant "
                    "audio reference is for workflow models)",
                    f"messages[{i}].content",
                )
        plan = plan_tools(req, tool_format_for(self.settings.tool_formats, req.model))
        constraint = one_constraint(constraint_of(req), plan)
        sampling = _sampling(req, self.settings.max_n, constraint and constraint.structured)
        template = template_options(req, plan)
        prep = await param_model(self.core.prepare_chat(req.model, messages, sampling, template))
        chat = _Chat(prep, req, rid, int(time.time()), arrived, plan)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = joined(self._chat_events(chat, include_usage), req.n)  # role chunks
            return await self._stream(events, [prep], req.n, constraint)
        work = self._chat_whole(chat)
        result = await naming(constraint, whole(request, work))
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result.model_dump())

    async def _chat_whole(self, chat: _Chat) -> ChatCompletion:
        prep, req, plan = chat.prep, chat.req, chat.plan
        tally = Tally("chat", chat.arrived)
        texts: dict[int, list[str]] = {i: [] for i in range(req.n)}
        lps: dict[int, list[TokenLogprob]] = {i: [] for i in range(req.n)}
        async with aclosing(self.core.merged([prep], req.n, whole=True)) as stream:
            async for i, chunk in stream:
                tally.saw(i, chunk)
                texts[i].append(chunk.text)
                if req.logprobs:
                    lps[i].extend(_token_logprobs(prep, chunk))
        usage = tally.done()
        choices = []
        for i in range(req.n):
            content: str | None = "".join(texts[i])
            calls, reason = None, tally.finish.get(i, "stop")
            if plan is not None and content is not None:
                content, calls = whole_answer(plan, content)
                reason = "tool_calls" if calls and reason == "stop" else reason
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=ChoiceLogprobs(content=lps[i]) if req.logprobs else None,
                    finish_reason=reason,
                )
            )
        return ChatCompletion(
            id=chat.rid, created=chat.created, model=req.model, choices=choices, usage=usage
        )

    async def _chat_events(self, chat: _Chat, include_usage: bool) -> AsyncIterator[bytes]:
        prep, req, plan = chat.prep, chat.req, chat.plan
        tally = Tally("chat", chat.arrived)
        calls = {i: StreamedCalls(plan) for i in range(req.n)} if plan is not None else None

        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
            return sse(
                ChatCompletionChunk(
                    id=chat.rid, created=chat.created, model=req.model, choices=choices, usage=usage
                )
            )

        for i in range(req.n):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
        async with aclosing(self.core.merged([prep], req.n)) as stream:
            async for i, c in stream:
                tally.saw(i, c)
                lp = None
                if req.logprobs and c.token_ids:
                    lp = ChoiceLogprobs(content=_token_logprobs(prep, c))
                if calls is not None:  # tools: content and calls as the parser finds them
                    deltas = calls[i].feed(c.text) + (calls[i].end() if c.finish_reason else [])
                    for k, d in enumerate(deltas or ([Delta()] if lp else [])):
                        yield chunk([ChunkChoice(index=i, delta=d, logprobs=None if k else lp)])
                elif c.text or lp:
                    yield chunk([ChunkChoice(index=i, delta=Delta(content=c.text), logprobs=lp)])
                if c.finish_reason:
                    reason = calls[i].finish_reason(c.finish_reason) if calls else c.finish_reason
                    yield chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=reason)])
        usage = tally.done()
        if include_usage:
            yield chunk([], usage)
        yield DONE

    # ------------------------------------------------------------ completions

    async def completions(self, request: Request) -> Response:
        req = await parse_json(request, CompletionRequest)
        arrived = request.state.arrived
        rid = "cmpl-" + request.state.request_id.removeprefix("req-")
        prompts = _prompts(req.prompt)
        constraint = constraint_of(req)
        sampling = _sampling(req, self.settings.max_n, constraint and constraint.structured)
        if req.echo and req.logprobs is not None:
            raise bad_request(
                "echo with logprobs needs the prompt's logprobs, which this server does not "
                "compute: ask for one or the other",
                "echo",
            )
        if len(prompts) * req.n > self.settings.max_n:
            raise bad_request(
                f"{len(prompts)} prompts x n={req.n} is above this server's limit "
                f"{self.settings.max_n} choices",
                "prompt",
            )
        preps = [
            await param_model(self.core.prepare_prompt(req.model, p, sampling)) for p in prompts
        ]
        created = int(time.time())
        count = len(prompts) * req.n
        want_lp = req.logprobs is not None
        echoed = [
            _echo(p, prep) if req.echo else "" for p, prep in zip(prompts, preps, strict=True)
        ]

        def obj(choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
            return Completion(
                id=rid, created=created, model=req.model, choices=choices, usage=usage
            )

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[bytes]:
                tally = Tally("completions", arrived)
                unsent = set(range(count)) if req.echo else set()  # echo: the prompt first
                async with aclosing(self.core.merged(preps, req.n)) as stream:
                    async for i, c in stream:
                        tally.saw(i, c)
                        lp = _completion_logprobs(preps[i // req.n], [c]) if want_lp else None
                        head = echoed[i // req.n] if i in unsent else ""
                        unsent.discard(i)
                        body = "" if req.echo_only else c.text
                        if head or body or c.finish_reason:
                            choice = CompletionChoice(
                                index=i,
                                text=head + body,
                                logprobs=lp,
                                finish_reason=c.finish_reason or None,
                            )
                            yield sse(obj([choice]))
                usage = tally.done(len(prompts))
                if include_usage:
                    yield sse(obj([], usage))
                yield DONE

            return await self._stream(events(), preps, req.n, constraint)

        async def collect() -> Completion:
            tally = Tally("completions", arrived)
            chunks: dict[int, list[GenChunk]] = {i: [] for i in range(count)}
            async with aclosing(self.core.merged(preps, req.n, whole=True)) as stream:
                async for i, c in stream:
                    tally.saw(i, c)
                    chunks[i].append(c)
            usage = tally.done(len(prompts))
            choices = [
                CompletionChoice(
                    index=i,
                    text=echoed[i // req.n]
                    + ("" if req.echo_only else "".join(c.text for c in chunks[i])),
                    logprobs=_completion_logprobs(preps[i // req.n], chunks[i])
                    if want_lp
                    else None,
                    finish_reason=tally.finish.get(i, "stop"),
                )
                for i in range(count)
            ]
            return obj(choices, usage)

        result = await naming(constraint, whole(request, collect()))
        return Response(status_code=499) if result is None else JSONResponse(result.model_dump())

    # ------------------------------------------------------------ images and speech

    async def images(self, request: Request) -> Response:
        req = await parse_json(request, ImageRequest)
        width, height = _size(req.size)
        if req.n > self.settings.max_n:
            raise bad_request(f"n={req.n} is above this server's limit {self.settings.max_n}", "n")
        if req.model.startswith(WORKFLOW_PREFIX):  # size unset: the workflow's own
            size = (width, height) if "size" in req.model_fields_set else None
            return await self.workflows.images(request, req, size)

        async def one(i: int) -> str:
            seed = None if req.seed is None else (req.seed + i) % 2**63
            png = await self.core.image(req.model, req.prompt, width, height, seed)
            return base64.b64encode(png).decode()

        work = asyncio.gather(*(param_model(one(i)) for i in range(req.n)))
        images = await whole(request, work)
        if images is None:
            return Response(status_code=499)
        body = ImagesResponse(
            created=int(time.time()), data=[ImageData(b64_json=b) for b in images]
        )
        return JSONResponse(body.model_dump())

    async def speech(self, request: Request) -> Response:
        req = await parse_json(request, SpeechRequest)
        pcm = req.response_format == "pcm"  # OpenAI's pcm: raw 16-bit mono at 24 kHz
        rate = audio.PCM16_RATE if pcm else 0
        wav = await whole(
            request, param_model(self.core.speech(req.model, req.input, req.voice, rate))
        )
        if wav is None:
            return Response(status_code=499)
        body = audio.encode(wav, rate, "pcm16") if pcm else wav
        metrics.AUDIO_SECONDS.labels("speech").inc(_audio_seconds(body, pcm))
        return Response(body, media_type="audio/pcm" if pcm else "audio/wav")


def _message(m: ChatMessage) -> dict[str, Any]:
    """A request message as the core reads it: role (developer is system), content (a
    string, parts as dicts, or None) and an assistant's audio reference."""
    out: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": m.content
        if m.content is None or isinstance(m.content, str)
        else [p.model_dump(exclude_none=True) for p in m.content],
    }
    if m.audio is not None:
        out["audio"] = {"id": m.audio.id}
    if m.tool_calls:  # an earlier turn's calls, and the results that answer them
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _echo(prompt: str | list[int], prep: Prepared) -> str:
    """The prompt as completions' ``echo`` puts it before the text: as given, or the token
    ids decoded (special tokens kept), as vLLM does."""
    if isinstance(prompt, str):
        return prompt
    assert prep.pre is not None
    return prep.pre.decode(prompt, skip_special_tokens=False)


def _audio_seconds(body: bytes, pcm: bool) -> float:
    if pcm:
        return len(body) / 2 / audio.PCM16_RATE
    samples, rate = audio.pcm_of(body, audio.TALKER_DEFAULT_RATE)
    return len(samples) / 2 / rate


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request(
            "prompt is empty: send a string, a list of strings or token ids", "prompt"
        )
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    out: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not p:
            raise bad_request(f"prompt[{i}] is an empty token list", "prompt")
        out.append(p)  # type: ignore[arg-type]
    return out


def _size(size: str) -> tuple[int, int]:
    w, sep, h = size.lower().partition("x")
    if not (sep and w.isdigit() and h.isdigit()) or not (
        0 < int(w) <= MAX_IMAGE_SIDE and 0 < int(h) <= MAX_IMAGE_SIDE
    ):
        raise bad_request(
            f"size {size!r} is not accepted: give 'WxH' with sides 1..{MAX_IMAGE_SIDE}", "size"
        )
    return int(w), int(h)


def _token_text(prep: Prepared, token_id: int) -> str:
    assert prep.pre is not None
    return prep.pre.decode([token_id], skip_special_tokens=False)


def _token_logprobs(prep: Prepared, chunk: GenChunk) -> list[TokenLogprob]:
    out = []
    for k, (tid, lp) in enumerate(zip(chunk.token_ids, chunk.logprobs, strict=False)):
        tops = chunk.top_logprobs[k] if k < len(chunk.top_logprobs) else []
        text = _token_text(prep, tid)
        out.append(
            TokenLogprob(
                token=text,
                logprob=lp,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                    for t, v in ((_token_text(prep, a), b) for a, b in tops)
                ],
            )
        )
    return out


def _completion_logprobs(prep: Prepared, chunks: list[GenChunk]) -> CompletionLogprobs:
    lp = CompletionLogprobs(top_logprobs=[])
    offset = 0
    for c in chunks:
        for k, (tid, v) in enumerate(zip(c.token_ids, c.logprobs, strict=False)):
            text = _token_text(prep, tid)
            lp.tokens.append(text)
            lp.token_logprobs.append(v)
            lp.text_offset.append(offset)
            offset += len(text)
            tops = c.top_logprobs[k] if k < len(c.top_logprobs) else []
            assert lp.top_logprobs is not None
            lp.top_logprobs.append({_token_text(prep, a): b for a, b in tops})
    return lp
