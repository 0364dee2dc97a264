"""A TEST worker: a real WorkerService process with fake compute, for tests, benches and
examples while the real engines are not in a worker.

``python -m omniflow.testing.echo_worker`` registers in discovery like a worker (role,
node, operations) and serves:

- ``Generate``: streams ``"echo: <prompt>"`` word by word (``max_tokens`` words at most;
  a prompt of token ids is echoed as its numbers, a chat prompt as its last user turn),
  one word per step of a fake continuous-batching engine (``echo_engine``): prompt bytes
  are tokens, a step costs a fixed time plus a time per request in decode plus a time
  per prompt token computed, concurrent requests share the steps, and a finite LRU
  prefix cache over block hashes of the prompt (page of 16 bytes, the project's hash
  contract) spares the prefill of cached leading blocks. Blocks stored and evicted are
  published to the KV index through its Redis when ``OMNIFLOW_ECHO_PUBLISH_KV`` is set,
  so ``kv_aware`` routing sees them.
- ``Synthesize``: streams fake 16-bit PCM (160 samples per character of text).
- ``Invoke``: ``upper``, ``classify`` (``math`` when the text has a digit, else
  ``chat``), ``critique`` (appends "+" and scores len/20), ``sleep`` (``ms``), ``fail``
  (UNAVAILABLE), ``noop``, ``stats`` (calls, cancelled calls, cache hits, prefill work)
  and ``reset`` (empties the prefix cache, tells the index, zeroes the counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.config import CommonSettings, setting
from omniflow.errors import InvalidArgument, NotFound, Unavailable
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.operations import served
from omniflow.rpc.server import Runtime, ServiceApp, serve_main
from omniflow.testing.echo_engine import ComputeModel, EchoEngine
from omniflow.values import from_python, to_python
from omniflow.workers import WORKER_SERVICE, worker_metadata

log = logging.getLogger(__name__)

INVOKE_OPS = ("upper", "classify", "critique", "sleep", "fail", "noop", "stats", "reset")
# The built-in operations of the two roles this test worker can stand in for.
BUILTIN_OPS = {role: served(role) for role in ("llm", "talker")}
ECHO_LAYOUT = KVLayout("echo-bytes", 1, 1, 1, "float32", 16)


@dataclass(frozen=True, slots=True)
class EchoSettings(CommonSettings):
    """Settings of the test worker (plus the common ones)."""

    role: str = setting("OMNIFLOW_WORKER_ROLE", "llm", "role this test worker registers as")
    weight: float = setting("OMNIFLOW_ECHO_WEIGHT", 1.0, "weight in discovery metadata")
    token_delay_ms: float = setting(
        "OMNIFLOW_ECHO_TOKEN_DELAY_MS",
        0.0,
        "fixed time of one engine step (one generated word per request in decode)",
        minimum=0,
    )
    prefill_us_per_token: float = setting(
        "OMNIFLOW_ECHO_PREFILL_US", 0.0, "prefill time per uncached prompt byte", minimum=0
    )
    decode_us: float = setting(
        "OMNIFLOW_ECHO_DECODE_US", 0.0, "step time added per request in decode", minimum=0
    )
    step_tokens: int = setting(
        "OMNIFLOW_ECHO_STEP_TOKENS", 2048, "prefill budget of one step, in bytes", minimum=1
    )
    max_running: int = setting(
        "OMNIFLOW_ECHO_MAX_RUNNING", 256, "requests batched together; more wait", minimum=1
    )
    cache_blocks: int = setting(
        "OMNIFLOW_ECHO_CACHE_BLOCKS", 4096, "prefix cache capacity in blocks (LRU)", minimum=1
    )
    publish_kv: bool = setting(
        "OMNIFLOW_ECHO_PUBLISH_KV", False, "publish cached blocks to the KV index's Redis"
    )


class EchoCore:
    """Counters of the test worker (the compute and the cache are in ``engine``)."""

    def __init__(self, engine: EchoEngine) -> None:
        self.engine = engine
        self.calls = 0
        self.cancelled = 0
        self.running = 0


def _last_user_turn(chat: worker_pb2.ChatMessages) -> str:
    """A chat prompt (node param ``chat``) is echoed as its last user turn's text."""
    users = [m for m in chat.messages if m.role == "user"]
    return "".join(part.text for part in users[-1].content) if users else ""


class EchoServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, app: EchoWorkerApp) -> None:
        self.app = app
        self.core = app.core

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        core = self.core
        core.calls += 1
        core.running += 1
        req = None
        try:
            # Token ids (what the gateway sends) are echoed as numbers: answers stay checkable.
            prompt = (
                request.text
                or " ".join(map(str, request.token_ids.ids))
                or _last_user_turn(request.messages)
            )
            data = prompt.encode()
            hashes = block_hashes(ECHO_LAYOUT.namespace, list(data), ECHO_LAYOUT.page_size)
            words = f"echo: {prompt}".split(" ")
            limit = request.sampling.max_tokens or len(words)
            words = words[:limit]
            req = core.engine.submit(len(data), hashes, len(words))
            for i, word in enumerate(words):
                if await req.tokens.get() is None:
                    break
                last = i == len(words) - 1
                chunk = worker_pb2.GenerateResponse(
                    request_id=request.request_id, text=word if i == 0 else " " + word
                )
                if last:
                    chunk.finish_reason = worker_pb2.FINISH_REASON_STOP
                    chunk.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=len(data),
                            cached_tokens=req.cached,
                            completion_tokens=len(words),
                        )
                    )
                    chunk.prompt_block_hashes.extend(hashes)
                yield chunk
        except asyncio.CancelledError:
            core.cancelled += 1
            raise
        finally:
            core.running -= 1
            if req is not None:
                core.engine.cancel(req)

    async def Synthesize(
        self, request: worker_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SynthesizeResponse]:
        self.core.calls += 1
        rate = request.sample_rate or 16000
        text = request.text
        for i in range(0, max(len(text), 1), 8):
            piece = text[i : i + 8]
            pcm = bytes(320 * len(piece))  # 160 silent 16-bit samples per character
            last = i + 8 >= len(text)
            yield worker_pb2.SynthesizeResponse(
                pcm_s16le=pcm, sample_rate=rate, chunk_index=i // 8, last=last
            )

    async def Invoke(
        self, request: worker_pb2.InvokeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InvokeResponse:
        core = self.core
        op = request.operation
        inputs = {k: to_python(v) for k, v in request.inputs.items()}
        if op in ("stats", "reset"):  # not counted: it would count itself
            return self._reply(await self._invoke(op, inputs))
        core.calls += 1
        core.running += 1
        try:
            out = await self._invoke(op, inputs)
        except asyncio.CancelledError:
            core.cancelled += 1
            raise
        finally:
            core.running -= 1
        return self._reply(out)

    @staticmethod
    def _reply(out: dict) -> worker_pb2.InvokeResponse:
        return worker_pb2.InvokeResponse(
            outputs={k: from_python(v, f"output {k!r}") for k, v in out.items()}
        )

    async def _invoke(self, op: str, inputs: dict) -> dict:
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
            return {"slept_ms": ms, "worker": self.app.instance_id}
        if op == "noop":
            return {"text": text}
        if op == "fail":
            raise Unavailable(f"test worker {self.app.instance_id} fails on purpose")
        if op == "stats":
            c, e = self.core, self.core.engine
            return {
                "calls": c.calls,
                "cancelled": c.cancelled,
                "running": c.running,
                "hit_tokens": e.hit_tokens,
                "prompt_tokens": e.prompt_tokens,
                "computed_tokens": e.computed_tokens,
                "cached_blocks": len(e.cache),
                "steps": e.steps,
                "busy_s": e.busy_s,
                "worker": self.app.instance_id,
            }
        if op == "reset":
            await self.app.reset()
            return {"worker": self.app.instance_id}
        raise NotFound(f"unknown operation {op!r}; this test worker serves {', '.join(INVOKE_OPS)}")

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        cache = self.core.engine.cache
        return worker_pb2.GetLoadResponse(
            load=common_pb2.WorkerLoad(
                running_requests=len(self.core.engine.running),
                waiting_requests=len(self.core.engine.waiting),
                free_pages=max(cache.capacity - len(cache), 0),
                total_pages=cache.capacity,
            )
        )

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetInfoResponse:
        rt = self.app.runtime
        info = common_pb2.WorkerInfo(
            worker_id=self.app.instance_id,
            role=self.app.settings.role,
            address=rt.address if rt else "",
            node=rt.node if rt else "",
            model="echo",
            operations=list(self.app.operations()),
            healthy=True,
        )
        return worker_pb2.GetInfoResponse(info=info)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=False)

    async def Encode(self, request: object, context: grpc.aio.ServicerContext) -> object:
        raise InvalidArgument("the echo test worker does not encode")


class EchoWorkerApp(ServiceApp):
    """The test worker process."""

    name = WORKER_SERVICE

    def __init__(self, settings: EchoSettings) -> None:
        self.settings = settings
        model = ComputeModel(
            prefill_us=settings.prefill_us_per_token,
            decode_us=settings.decode_us,
            step_us=settings.token_delay_ms * 1000,
            step_tokens=settings.step_tokens,
            max_running=settings.max_running,
        )
        engine = EchoEngine(model, settings.cache_blocks, ECHO_LAYOUT.page_size, self._on_blocks)
        self.core = EchoCore(engine)
        self.runtime: Runtime | None = None
        self._kv: object | None = None
        self._lease: object | None = None
        self._seq = 0
        self._redis: object | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Block events not yet sent to the index, in the order the cache changed.
        self._events: list[tuple[int, bytes]] = []
        self._pending = asyncio.Event()
        self._send_lock = asyncio.Lock()

    @property
    def instance_id(self) -> str:
        return self.runtime.instance_id if self.runtime else ""

    def operations(self) -> tuple[str, ...]:
        return (*BUILTIN_OPS.get(self.settings.role, ()), *INVOKE_OPS)

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(EchoServicer(self), server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._tasks.append(asyncio.create_task(self.core.engine.run()))
        if self.settings.publish_kv:
            from omniflow.kv.index_store import KVIndex, OwnerInfo, OwnerKind
            from omniflow.localredis import redis_client

            self._redis = redis_client(self.settings.redis_url, 5.0)
            index = KVIndex(self._redis)  # type: ignore[arg-type]
            await index.start()
            await index.register_namespace(ECHO_LAYOUT)
            owner = OwnerInfo(runtime.instance_id, runtime.node, runtime.address, OwnerKind.WORKER)
            self._lease = await index.register_owner(owner, lease_ms=3_600_000)
            self._kv = index
            self._tasks.append(asyncio.create_task(self._publisher()))

    def _on_blocks(self, stored: list[bytes], evicted: list[bytes]) -> None:
        if self._kv is None:
            return
        from omniflow.kv.events import EventKind

        # Evictions too: an index that still lists evicted blocks misleads the router.
        self._events.extend((EventKind.STORED, h) for h in stored)
        self._events.extend((EventKind.REMOVED, h) for h in evicted)
        self._pending.set()

    async def _publisher(self) -> None:
        """Sends the cache's changes to the index in order, batched, off the engine's path."""
        while True:
            await self._pending.wait()
            self._pending.clear()
            await self._flush()

    async def _flush(self) -> None:
        from omniflow.kv.events import BlockEvent, EventKind, Tier

        async with self._send_lock:  # one sender at a time keeps the batches in order
            events, self._events = self._events, []
            for i in range(0, len(events), 4096):
                batch = [
                    BlockEvent(EventKind(k), ECHO_LAYOUT.namespace, h, Tier.DEVICE)
                    if k != EventKind.CLEARED
                    else BlockEvent(EventKind.CLEARED)
                    for k, h in events[i : i + 4096]
                ]
                self._seq += 1
                try:
                    await self._kv.apply_events(  # type: ignore[attr-defined]
                        self.instance_id,
                        self._lease.epoch,  # type: ignore[attr-defined]
                        self._seq,
                        batch,
                    )
                except Exception as exc:  # the index is an accelerator: log and go on
                    log.warning("publishing %d block events failed: %s", len(batch), exc)

    async def reset(self) -> None:
        """Empty the prefix cache (the index hears it in order) and zero the counters."""
        self.core.engine.clear_cache()
        e = self.core.engine
        e.prompt_tokens = e.hit_tokens = e.computed_tokens = e.steps = 0
        e.busy_s = 0.0
        self.core.calls = self.core.cancelled = 0
        if self._kv is not None:
            from omniflow.kv.events import EventKind

            self._events.append((EventKind.CLEARED, b""))
            await self._flush()

    def metadata(self) -> dict[str, str]:
        node = self.runtime.node if self.runtime else ""
        meta = worker_metadata(
            self.settings.role, node, "echo", ECHO_LAYOUT.namespace_hex, self.operations()
        )
        meta["weight"] = str(self.settings.weight)
        meta["test_worker"] = "echo"
        return meta

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.deregister_owner(self.instance_id)  # type: ignore[attr-defined]
        if self._redis is not None:
            await self._redis.aclose()  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    return serve_main(EchoSettings, EchoWorkerApp, "Omni-Flow echo TEST worker", argv)


if __name__ == "__main__":
    os.environ.setdefault("OMNIFLOW_LOG_LEVEL", "WARNING")
    sys.exit(main())
