"""How the gateway answers: server-sent events, whole replies raced against the client's
disconnect, usage objects, and domain errors as OpenAI errors (also mid-stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from omniflow.errors import OmniflowError
from omniflow_services.gateway import access
from omniflow_services.gateway.errors import APIError, from_domain
from omniflow_services.gateway.protocol import PromptTokensDetails, Usage, error_body

T = TypeVar("T")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse(obj: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event holding ``obj`` as JSON."""
    if isinstance(obj, BaseModel):
        body = obj.model_dump_json()
    else:
        body = json.dumps(obj, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


def usage(prompt: int, cached: int, completion: int) -> Usage:
    access.note_usage(prompt, cached, completion)  # the request's line in the access log
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def whole(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` unless the client disconnects first (then cancel it: None)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


class EventStream(StreamingResponse):
    """Starlette's streaming response, streamed in the request's own task.

    Under uvicorn (ASGI spec 2.3) starlette runs the stream in a task group beside a task
    waiting for the client's disconnect: a task group, a task and a hop before the first
    byte of every response. Here the stream runs in place and one watcher waits for the
    disconnect; when the client leaves, it cancels the stream (which ends the worker's
    call, as before), and the response ends quietly as starlette's does."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        over = False

        def gone(watch: asyncio.Future[None]) -> None:
            if not over and not watch.cancelled() and watch.exception() is None:
                task.cancel()

        watch = asyncio.ensure_future(_disconnected_from(receive))
        watch.add_done_callback(gone)
        try:
            await self.stream_response(send)
            over = True
        except asyncio.CancelledError:
            if not (watch.done() and not watch.cancelled()):
                raise  # cancelled from elsewhere (shutdown): not ours to swallow
            task.uncancel()
        finally:
            over = True
            watch.remove_done_callback(gone)
            watch.cancel()
        if self.background is not None:
            await self.background()


def streaming(
    events: AsyncIterator[bytes], release: Callable[[], None] = lambda: None
) -> StreamingResponse:
    """SSE of ``events``; ``release`` runs at the end, whatever happened."""
    return EventStream(
        _guarded(events, release), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def joined(events: AsyncIterator[bytes], count: int) -> AsyncIterator[bytes]:
    """``events`` with its first ``count`` items sent together with the next one, as one
    write: a chat stream's role chunks go with its first output (vLLM's server sends them
    then too), so that no write to the client comes before the worker is called."""
    head: list[bytes] = []
    async with aclosing(events) as stream:
        async for data in stream:
            if count:
                head.append(data)
                count -= 1
                continue
            if head:
                data, head = b"".join((*head, data)), []
            yield data
    if head:
        yield b"".join(head)


async def param_model(work: Awaitable[T]) -> T:
    """``work``, with an unknown model's NotFound naming the ``model`` param."""
    try:
        return await work
    except OmniflowError as exc:
        err = from_domain(exc)
        if err.status == 404:
            err.param = "model"
        raise err from None


async def _guarded(
    events: AsyncIterator[bytes], release: Callable[[], None]
) -> AsyncIterator[bytes]:
    """SSE with errors after the first byte sent as an error event (the status is sent)."""
    try:
        async with aclosing(events) as stream:
            async for data in stream:
                yield data
    except (APIError, OmniflowError) as exc:
        err = exc if isinstance(exc, APIError) else from_domain(exc)
        yield sse(error_body(err.message, err.type, err.param, err.code))
        yield DONE
    finally:
        release()


async def _disconnected(request: Request) -> None:
    await _disconnected_from(request.receive)


async def _disconnected_from(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
