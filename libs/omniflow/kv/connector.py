"""``AgentConnector``: the engine's ``KVConnector`` protocol on top of ``KVClient``.

The engine (services/worker/engine/connector.py) calls ``fetch_pages`` and
``store_pages`` from its own thread, synchronously. This adapter runs a ``KVClient`` on an
event loop of its own: ``fetch_pages`` waits for the pages (copied out of the arena and
verified against their checksums, then unpinned), ``store_pages`` only schedules the
write-through and returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from omniflow.kv.blocking import LoopThread
from omniflow.kv.blocks import KVLayout
from omniflow.kv.checksum import page_checksum
from omniflow.kv.client import KVClient

log = logging.getLogger(__name__)


class AgentConnector:
    """A ``KVConnector`` backed by the node's kv-agent (and the index, when given)."""

    def __init__(
        self,
        agent_address: str,
        index_address: str = "",
        *,
        device_owner_id: str = "",
        timeout_s: float = 5.0,
    ) -> None:
        self.timeout_s = timeout_s
        self._loop = LoopThread("kv-connector")
        self._registered: set[bytes] = set()
        self._queued: set[Future[bool]] = set()
        # Write-throughs not acknowledged yet, by block hash (pending_writes).
        self._writes: dict[bytes, Future[bool]] = {}
        self._writes_lock = threading.Lock()

        async def make() -> KVClient:
            return KVClient(
                agent_address, index_address, device_owner_id=device_owner_id, timeout_s=timeout_s
            )

        self.client: KVClient = self._run(make())

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, self.timeout_s * 3)

    async def _ensure_namespace(self, layout: KVLayout) -> bytes:
        ns = layout.namespace
        if ns not in self._registered and self.client.index_address:
            await self.client.register_namespace(layout)
            self._registered.add(ns)
        return ns

    async def _fetch(self, layout: KVLayout, hashes: list[bytes]) -> list[bytes]:
        ns = await self._ensure_namespace(layout)
        async with await self.client.acquire(ns, hashes) as pages:
            out = [view.tobytes() for view in pages.views]
            checksums = list(pages.checksums)
        # Verified on the copies: what the engine gets is what the agent vouched for.
        good = []
        for blob, want in zip(out, checksums, strict=True):
            if page_checksum(blob) != want:
                break
            good.append(blob)
        return good

    def fetch_pages(self, layout: KVLayout, hashes: Sequence[bytes]) -> list[bytes]:
        """Bytes of the longest leading run of ``hashes`` the Data Flow layer has."""
        return self._run(self._fetch(layout, list(hashes)))

    async def _store(self, layout: KVLayout, hashes: list[bytes], pages: list[bytes]) -> bool:
        """True once the agent committed the pages; False when the store was dropped or
        failed (the client counts and logs those)."""
        ns = await self._ensure_namespace(layout)
        task = self.client.store(ns, hashes, pages)
        if task is None:
            return False
        await asyncio.wait([task])
        return not task.cancelled() and task.exception() is None

    def store_pages(
        self, layout: KVLayout, hashes: Sequence[bytes], pages: Sequence[bytes]
    ) -> None:
        """Queue a write-through of full pages; returns at once."""
        fut = self._loop.submit(self._store(layout, list(hashes), list(pages)))
        self._queued.add(fut)
        keys = list(hashes)
        with self._writes_lock:
            for h in keys:
                self._writes[h] = fut
        fut.add_done_callback(self._queued_done)
        fut.add_done_callback(lambda f: self._forget(f, keys))

    def _forget(self, fut: Future[bool], hashes: list[bytes]) -> None:
        with self._writes_lock:
            for h in hashes:
                if self._writes.get(h) is fut:  # a later write of the same page stays
                    del self._writes[h]

    def _queued_done(self, fut: Future[bool]) -> None:
        self._queued.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("kv write-through not queued: %s", fut.exception())

    def pending_writes(self, hashes: Sequence[bytes]) -> list[Future[bool]]:
        """The write-throughs of ``hashes`` not acknowledged by the agent yet (each resolves
        True once committed, False when dropped or failed). A hash with none is either
        stored already or was never written through by this connector."""
        with self._writes_lock:
            found = {id(f): f for h in hashes if (f := self._writes.get(h)) is not None}
        return list(found.values())

    def flush(self) -> None:
        """Wait for queued write-throughs (tests, shutdown)."""
        for fut in list(self._queued):
            fut.exception(timeout=self.timeout_s * 3)
        self._run(self.client.flush())

    def close(self) -> None:
        try:
            self._run(self.client.close())
        finally:
            self._loop.stop()
