"""gRPC edge of what the echo engine serves besides Generate: its ``Invoke`` operations and
a fake ``Synthesize`` (the worker's edge, ``server.py``, hands them here).

``Invoke``: ``upper``, ``classify`` (``math`` when the text has a digit, else ``chat``),
``critique`` (appends "+" and scores len/20), ``sleep`` (``ms``), ``fail`` (UNAVAILABLE: a
fault on purpose, for the failover and chaos tests), ``noop``, ``stats`` (calls, cancelled
calls, cache hits, prefill work) and ``reset`` (empties the prefix cache, tells the index,
zeroes the counters). ``Synthesize`` streams silent 16-bit PCM, 160 samples per character.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from omniflow.api.worker.v1 import worker_pb2
from omniflow.errors import NotFound, Unavailable
from omniflow.values import from_python, to_python
from omniflow_services.worker.echo.role import ECHO_OPERATIONS, EchoRole


async def invoke_echo(
    role: EchoRole, request: worker_pb2.InvokeRequest, worker_id: str
) -> worker_pb2.InvokeResponse:
    op = request.operation
    inputs = {k: to_python(v) for k, v in request.inputs.items()}
    if op in ("stats", "reset"):  # not counted: it would count itself
        return _reply(await _invoke(role, op, inputs, worker_id))
    role.calls += 1
    role.running += 1
    try:
        out = await _invoke(role, op, inputs, worker_id)
    except asyncio.CancelledError:
        role.cancelled += 1
        raise
    finally:
        role.running -= 1
    return _reply(out)


def _reply(out: dict[str, Any]) -> worker_pb2.InvokeResponse:
    return worker_pb2.InvokeResponse(
        outputs={k: from_python(v, f"output {k!r}") for k, v in out.items()}
    )


async def _invoke(role: EchoRole, op: str, inputs: dict[str, Any], worker: str) -> dict[str, Any]:
    text = str(inputs.get("text", ""))
    if op == "upper":
        return {"text": text.upper()}
    if op == "classify":
        return {"label": "math" if any(c.isdigit() for c in text) else "chat"}
    if op == "critique":
        revised = text + "+"
        return {"text": revised, "score": min(len(revised) / 20, 1.0)}
    if op == "sleep":
        ms = float(inputs.get("ms", 100))
        await asyncio.sleep(ms / 1000)
        return {"slept_ms": ms, "worker": worker}
    if op == "noop":
        return {"text": text}
    if op == "fail":
        raise Unavailable(f"echo worker {worker} fails on purpose")
    if op == "stats":
        e = role.engine
        return {
            "calls": role.calls,
            "cancelled": role.cancelled,
            "running": role.running,
            "hit_tokens": e.hit_tokens,
            "prompt_tokens": e.prompt_tokens,
            "computed_tokens": e.computed_tokens,
            "cached_blocks": len(e.cache),
            "steps": e.steps,
            "busy_s": e.busy_s,
            "worker": worker,
        }
    if op == "reset":
        await role.reset()
        return {"worker": worker}
    raise NotFound(f"unknown operation {op!r}; the echo engine serves {', '.join(ECHO_OPERATIONS)}")


async def synthesize_echo(
    role: EchoRole, request: worker_pb2.SynthesizeRequest
) -> AsyncIterator[worker_pb2.SynthesizeResponse]:
    role.calls += 1
    rate = request.sample_rate or 16000
    text = request.text
    for i in range(0, max(len(text), 1), 8):
        piece = text[i : i + 8]
        yield worker_pb2.SynthesizeResponse(
            pcm_s16le=bytes(320 * len(piece)),  # 160 silent 16-bit samples per character
            sample_rate=rate,
            chunk_index=i // 8,
            last=i + 8 >= len(text),
        )
