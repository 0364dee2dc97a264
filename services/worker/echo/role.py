"""``EchoRole``: the echo engine behind the worker edge (``OMNIFLOW_WORKER_ENGINE=echo``).

- ``Generate`` streams ``"echo: <prompt>"`` word by word (``max_tokens`` words at most), one
  word per step of the fake engine (``echo.engine``). A text prompt is echoed as its text, a
  chat prompt as its last user turn, token ids (what the gateway sends) as their numbers:
  answers stay checkable. Prompt bytes are the engine's tokens: the prompt is encoded as
  ids ``BYTE_BASE + byte``, its block hashes are those of its bytes in pages of 16
  (``ECHO_LAYOUT``, the project's hash contract, not salted), which the prefix cache and,
  with ``OMNIFLOW_ECHO_PUBLISH_KV``, the KV index hold (``echo.index``).
- ``Abort`` ends a request with finish reason ``abort``.
- ``Invoke`` operations and ``Synthesize`` are in ``echo.edge``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omniflow.kv.blocks import block_hashes
from omniflow.rpc.server import Runtime
from omniflow.sampling import SamplingParams
from omniflow.security.tenancy import scoped_id
from omniflow.tasks import stop_task
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.echo.engine import (
    ECHO_LAYOUT,
    ComputeModel,
    EchoEngine,
    EngineRequest,
)
from omniflow_services.worker.echo.index import EchoIndex
from omniflow_services.worker.llm.role import LLMRole
from omniflow_services.worker.llm.types import RequestOutput, Usage

#: A prompt byte ``b`` is the token id ``BYTE_BASE + b``; ids below it are token ids given
#: by the caller, echoed as numbers.
BYTE_BASE = 1 << 20
#: What the echo engine advertises as its context (it holds any prompt the bounds let in).
ECHO_CONTEXT = 1 << 20
#: Its Invoke operations (``echo.edge``), and the built-in roles it stands in for.
ECHO_OPERATIONS = ("upper", "classify", "critique", "sleep", "fail", "noop", "stats", "reset")
STANDS_IN_FOR = ("llm", "talker")


def prompt_text(ids: Sequence[int]) -> str:
    """What the echo engine echoes for ``ids``: the text of byte ids, else the numbers."""
    if ids and all(i >= BYTE_BASE for i in ids):
        return bytes(i - BYTE_BASE for i in ids).decode("utf-8", "replace")
    return " ".join(map(str, ids))


def _text_ids(text: str) -> list[int]:
    return [BYTE_BASE + b for b in text.encode()]


class EchoRole(LLMRole):
    """The echo engine as the worker's llm role, with the counters ``stats`` reports."""

    engine: EchoEngine

    def __init__(self, settings: WorkerSettings) -> None:
        model = ComputeModel(
            prefill_us=settings.echo_prefill_us,
            decode_us=settings.echo_decode_us,
            step_us=settings.echo_token_delay_ms * 1000,
            step_tokens=settings.echo_step_tokens,
            max_running=settings.echo_max_running,
        )
        engine = EchoEngine(model, settings.echo_cache_blocks, ECHO_LAYOUT.page_size, self._blocks)
        super().__init__(engine, Path("echo"))
        self.settings = settings
        self.calls = 0
        self.cancelled = 0
        self.running = 0
        self.index: EchoIndex | None = None
        self._active: dict[str, EngineRequest] = {}
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def load(cls, settings: WorkerSettings) -> EchoRole:
        """The role with its engine's clock running (until ``close``)."""
        role = cls(settings)
        role._task = asyncio.create_task(role.engine.run())
        return role

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    def operations(self, role: str, served: tuple[str, ...]) -> tuple[str, ...]:
        """What a worker of ``role`` advertises: the role's own operations (``served``) when
        it is one the echo engine stands in for, then the echo operations."""
        return (*(served if role in STANDS_IN_FOR else ()), *ECHO_OPERATIONS)

    def metadata(self) -> dict[str, str]:
        """Discovery metadata beyond a worker's (the weight of the weighted strategy)."""
        return {"weight": str(self.settings.echo_weight), "test_worker": "echo"}

    def context_length(self) -> int:
        return ECHO_CONTEXT

    async def warm_up(self) -> None:
        """Nothing to warm: no model."""

    async def encode_text(self, text: str) -> list[int]:
        return _text_ids(text)

    async def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The last user turn's text (a chat prompt is echoed as it)."""
        users = [m for m in messages if m.get("role") == "user"]
        content = users[-1].get("content", "") if users else ""
        if isinstance(content, str):
            return _text_ids(content)
        return _text_ids("".join(str(p.get("text", "")) for p in content))

    def prompt_hashes(self, ids: Sequence[int]) -> list[bytes]:
        data = prompt_text(ids).encode()
        return block_hashes(ECHO_LAYOUT.namespace, list(data), ECHO_LAYOUT.page_size)

    def attach_index(self, runtime: Runtime) -> EchoIndex | None:
        """With ``OMNIFLOW_ECHO_PUBLISH_KV``: the cache's blocks go to the KV index's Redis
        under a lease of this worker (the edge stops what this returns)."""
        if not self.settings.echo_publish_kv:
            return None
        self.index = EchoIndex(self.settings.redis_url, runtime)
        self.index.start()
        return self.index

    def _blocks(self, stored: list[bytes], evicted: list[bytes]) -> None:
        if self.index is not None:
            self.index.changed(stored, evicted)

    async def reset(self) -> None:
        """Empty the prefix cache (the index hears it in order) and zero the counters."""
        e = self.engine
        e.clear_cache()
        e.prompt_tokens = e.hit_tokens = e.computed_tokens = e.steps = 0
        e.busy_s = 0.0
        self.calls = self.cancelled = 0
        if self.index is not None:
            await self.index.cleared()

    def abort(self, given: str) -> bool:
        req = self._active.get(scoped_id(given))
        if req is None:
            return False
        self.engine.cancel(req)
        req.tokens.put_nowait(None)
        return True

    async def generate(
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.calls += 1
        self.running += 1
        prompt = prompt_text(ids)
        data = prompt.encode()
        words = f"echo: {prompt}".split(" ")
        words = words[: params.max_tokens or len(words)]
        req = self.engine.submit(len(data), self.prompt_hashes(ids), len(words))
        self._active[request_id] = req
        try:
            for i, word in enumerate(words):
                if await req.tokens.get() is None:  # aborted
                    usage = Usage(len(data), req.cached, i)
                    yield RequestOutput(request_id, (), "", True, "abort", usage)
                    return
                last = i == len(words) - 1
                yield RequestOutput(
                    request_id,
                    (),
                    word if i == 0 else " " + word,
                    last,
                    "stop" if last else None,
                    Usage(len(data), req.cached, i + 1),
                )
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self._active.pop(request_id, None)
            self.engine.cancel(req)
