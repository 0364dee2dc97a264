"""A TEST worker: a real WorkerService process with fake compute, for tests, benches and
examples while the real engines are not in a worker.

``python -m omniflow.testing.echo_worker`` registers in discovery like a worker (role,
node, operations) and serves:

- ``Generate``: streams ``"echo: <prompt>"`` word by word (``max_tokens`` words at most),
  after a fake prefill of ``prefill_us_per_token`` per prompt token not in its prefix
  cache; the cache is keyed by block hashes of the prompt bytes (page of 16 bytes, the
  project's hash contract), and the blocks are published to the KV index through its
  Redis when ``OMNIFLOW_ECHO_PUBLISH_KV`` is set, so ``kv_aware`` routing can see them.
- ``Synthesize``: streams fake 16-bit PCM (160 samples per character of text).
- ``Invoke``: ``upper``, ``classify`` (``math`` when the text has a digit, else
  ``chat``), ``critique`` (appends "+" and scores len/20), ``sleep`` (``ms``), ``fail``
  (UNAVAILABLE), ``noop``, and ``stats`` (calls, cancelled calls, cache hits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.config import CommonSettings, setting
from omniflow.errors import InvalidArgument, NotFound, Unavailable
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.rpc.server import Runtime, ServiceApp, serve_main
from omniflow.values import from_python, to_python
from omniflow.workers import WORKER_SERVICE, worker_metadata

log = logging.getLogger(__name__)

INVOKE_OPS = ("upper", "classify", "critique", "sleep", "fail", "noop", "stats")
BUILTIN_OPS = {"llm": ("generate",), "talker": ("synthesize",)}
ECHO_LAYOUT = KVLayout("echo-bytes", 1, 1, 1, "float32", 16)


@dataclass(frozen=True, slots=True)
class EchoSettings(CommonSettings):
    """Settings of the test worker (plus the common ones)."""

    role: str = setting("OMNIFLOW_WORKER_ROLE", "llm", "role this test worker registers as")
    weight: float = setting("OMNIFLOW_ECHO_WEIGHT", 1.0, "weight in discovery metadata")
    token_delay_ms: float = setting(
        "OMNIFLOW_ECHO_TOKEN_DELAY_MS", 0.0, "delay per generated word", minimum=0
    )
    prefill_us_per_token: float = setting(
        "OMNIFLOW_ECHO_PREFILL_US", 0.0, "fake prefill time per uncached prompt byte", minimum=0
    )
    cache_blocks: int = setting(
        "OMNIFLOW_ECHO_CACHE_BLOCKS", 4096, "prefix cache capacity in blocks", minimum=1
    )
    publish_kv: bool = setting(
        "OMNIFLOW_ECHO_PUBLISH_KV", False, "publish cached blocks to the KV index's Redis"
    )


class EchoCore:
    """The fake compute: a prefix cache over prompt blocks and some counters."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.calls = 0
        self.cancelled = 0
        self.running = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def admit(self, prompt: bytes) -> tuple[int, list[bytes], list[bytes]]:
        """(cached prompt bytes, all block hashes, new hashes) — and caches the prompt."""
        hashes = block_hashes(ECHO_LAYOUT.namespace, list(prompt), ECHO_LAYOUT.page_size)
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
            self.cache.move_to_end(h)
        new = [h for h in hashes[hit:] if h not in self.cache]
        for h in new:
            self.cache[h] = None
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        cached = hit * ECHO_LAYOUT.page_size
        self.hit_tokens += cached
        self.prompt_tokens += len(prompt)
        return cached, hashes, new


class EchoServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, app: EchoWorkerApp) -> None:
        self.app = app
        self.core = app.core

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        s = self.app.settings
        core = self.core
        core.calls += 1
        core.running += 1
        try:
            prompt = request.text
            cached, hashes, new = core.admit(prompt.encode())
            await self.app.publish(new)
            uncached = len(prompt.encode()) - cached
            if s.prefill_us_per_token:
                await asyncio.sleep(uncached * s.prefill_us_per_token / 1e6)
            words = f"echo: {prompt}".split(" ")
            limit = request.sampling.max_tokens or len(words)
            words = words[:limit]
            for i, word in enumerate(words):
                if s.token_delay_ms:
                    await asyncio.sleep(s.token_delay_ms / 1000)
                last = i == len(words) - 1
                chunk = worker_pb2.GenerateResponse(
                    request_id=request.request_id, text=word if i == 0 else " " + word
                )
                if last:
                    chunk.finish_reason = worker_pb2.FINISH_REASON_STOP
                    chunk.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=len(prompt.encode()),
                            cached_tokens=cached,
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
        if op == "stats":  # not counted: it would count itself
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
            c = self.core
            return {
                "calls": c.calls,
                "cancelled": c.cancelled,
                "running": c.running,
                "hit_tokens": c.hit_tokens,
                "prompt_tokens": c.prompt_tokens,
                "worker": self.app.instance_id,
            }
        raise NotFound(f"unknown operation {op!r}; this test worker serves {', '.join(INVOKE_OPS)}")

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        return worker_pb2.GetLoadResponse(
            load=common_pb2.WorkerLoad(running_requests=max(self.core.running, 0))
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
        self.core = EchoCore(settings.cache_blocks)
        self.runtime: Runtime | None = None
        self._kv: object | None = None
        self._lease: object | None = None
        self._seq = 0
        self._redis: object | None = None

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
        if self.settings.publish_kv:
            import redis.asyncio as aioredis

            from omniflow_services.kv_index.core import KVIndex, OwnerInfo, OwnerKind

            self._redis = aioredis.from_url(self.settings.redis_url)
            index = KVIndex(self._redis)  # type: ignore[arg-type]
            await index.start()
            await index.register_namespace(ECHO_LAYOUT)
            owner = OwnerInfo(runtime.instance_id, runtime.node, runtime.address, OwnerKind.WORKER)
            self._lease = await index.register_owner(owner, lease_ms=3_600_000)
            self._kv = index

    async def publish(self, hashes: list[bytes]) -> None:
        if self._kv is None or not hashes:
            return
        from omniflow.kv.events import BlockEvent, EventKind, Tier

        self._seq += 1
        events = [
            BlockEvent(EventKind.STORED, ECHO_LAYOUT.namespace, h, Tier.DEVICE) for h in hashes
        ]
        await self._kv.apply_events(self.instance_id, self._lease.epoch, self._seq, events)  # type: ignore[attr-defined]

    def metadata(self) -> dict[str, str]:
        node = self.runtime.node if self.runtime else ""
        meta = worker_metadata(
            self.settings.role, node, "echo", ECHO_LAYOUT.namespace_hex, self.operations()
        )
        meta["weight"] = str(self.settings.weight)
        meta["test_worker"] = "echo"
        return meta

    async def stop(self) -> None:
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
