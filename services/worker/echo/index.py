"""The echo engine's prefix cache in the KV index (``OMNIFLOW_ECHO_PUBLISH_KV``), so that
``kv_aware`` routing sees it: stored and evicted blocks go to the index's Redis through the
library's store, in the order the cache changed, batched, under a lease of the worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from omniflow.kv.events import BlockEvent, EventKind, Tier
from omniflow.kv.index_store import KVIndex, OwnerInfo, OwnerKind
from omniflow.localredis import redis_client
from omniflow.rpc.server import Runtime
from omniflow.tasks import stop_task
from omniflow_services.worker.echo.engine import ECHO_LAYOUT

log = logging.getLogger(__name__)

BATCH = 4096
LEASE_MS = 3_600_000  # a test worker: its lease outlives any run; stop deregisters it


class EchoIndex:
    """The cache's changes, sent to the index in order, off the engine's path."""

    def __init__(self, redis_url: str, runtime: Runtime) -> None:
        self.runtime = runtime
        self._redis: Any = redis_client(redis_url, 5.0)
        self._index = KVIndex(self._redis)
        self._lease: Any = None
        self._seq = 0
        self._events: list[tuple[EventKind, bytes]] = []
        self._pending = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        rt = self.runtime
        await self._index.start()
        await self._index.register_namespace(ECHO_LAYOUT)
        owner = OwnerInfo(rt.instance_id, rt.node, rt.address, OwnerKind.WORKER)
        self._lease = await self._index.register_owner(owner, lease_ms=LEASE_MS)
        self._ready.set()
        while True:
            await self._flush()
            await self._pending.wait()
            self._pending.clear()

    def changed(self, stored: list[bytes], evicted: list[bytes]) -> None:
        # Evictions too: an index that still lists evicted blocks misleads the router.
        self._events.extend((EventKind.STORED, h) for h in stored)
        self._events.extend((EventKind.REMOVED, h) for h in evicted)
        self._pending.set()

    async def cleared(self) -> None:
        """The cache was emptied: the index hears it after what came before."""
        self._events.append((EventKind.CLEARED, b""))
        if self._ready.is_set():
            await self._flush()

    async def _flush(self) -> None:
        async with self._send_lock:  # one sender at a time keeps the batches in order
            events, self._events = self._events, []
            for i in range(0, len(events), BATCH):
                batch = [
                    BlockEvent(k, ECHO_LAYOUT.namespace, h, Tier.DEVICE)
                    if k != EventKind.CLEARED
                    else BlockEvent(EventKind.CLEARED)
                    for k, h in events[i : i + BATCH]
                ]
                self._seq += 1
                try:
                    await self._index.apply_events(
                        self.runtime.instance_id, self._lease.epoch, self._seq, batch
                    )
                except Exception as exc:  # the index is an accelerator: log and go on
                    log.warning("publishing %d block events failed: %s", len(batch), exc)

    async def stop(self) -> None:
        await stop_task(self._task)
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._index.deregister_owner(self.runtime.instance_id)
        await self._redis.aclose()
