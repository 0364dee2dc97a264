"""The hook between an llm engine's device pool and the data plane (DESIGN.md §4.3).

On a prefix miss in the device pool the engine asks a ``KVConnector`` for pages by block
hash and writes newly computed full pages through to it. Page bytes are in the KVLayout byte
order of the built-in engine's ``KVPool`` (K then V; layer, head, token, dim).

Here too are what serve the protocol: ``AgentConnector``, the node's kv-agent (and the
index) through ``KVClient``; ``MemoryConnector``, a real in-process implementation (pages
exported by one engine served to another in the same process); and ``find_data_plane``, the
kv-agent and kv-index a worker's engine reaches (the vLLM and SGLang backends too).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from omniflow.discovery import find_address
from omniflow.kv.blocking import LoopThread
from omniflow.kv.blocks import KVLayout
from omniflow.kv.checksum import page_checksum
from omniflow.kv.client import KVClient

if TYPE_CHECKING:
    from omniflow_services.worker.config import WorkerSettings

log = logging.getLogger(__name__)


@runtime_checkable
class KVConnector(Protocol):
    """Pages beyond the device pool. Any exception is treated as a miss and counted."""

    def fetch_pages(self, layout: KVLayout, hashes: Sequence[bytes]) -> list[bytes]:
        """Bytes of the longest leading run of ``hashes`` available (possibly empty).

        Each item must be exactly ``layout.page_bytes`` long; the engine verifies that.
        """
        ...

    def store_pages(
        self, layout: KVLayout, hashes: Sequence[bytes], pages: Sequence[bytes]
    ) -> None:
        """Accept full pages just computed (write-through). Should not block for long:
        an implementation queues the transfer and returns."""
        ...


@runtime_checkable
class BlockEventSink(Protocol):
    """Receives device-pool block events (for the KV index), once per engine step."""

    def publish(
        self, layout: KVLayout, stored: Sequence[bytes], removed: Sequence[bytes]
    ) -> None: ...


class MemoryConnector:
    """A bounded, thread-safe in-process page store keyed by (namespace, block hash)."""

    def __init__(self, capacity_pages: int = 4096) -> None:
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[tuple[bytes, bytes], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.fetched = 0
        self.stored = 0

    def __len__(self) -> int:
        return len(self._pages)

    def fetch_pages(self, layout: KVLayout, hashes: Sequence[bytes]) -> list[bytes]:
        ns = layout.namespace
        out: list[bytes] = []
        with self._lock:
            for h in hashes:
                blob = self._pages.get((ns, h))
                if blob is None:
                    break
                self._pages.move_to_end((ns, h))
                out.append(blob)
            self.fetched += len(out)
        return out

    def store_pages(
        self, layout: KVLayout, hashes: Sequence[bytes], pages: Sequence[bytes]
    ) -> None:
        ns = layout.namespace
        with self._lock:
            for h, blob in zip(hashes, pages, strict=True):
                self._pages[(ns, h)] = blob
                self._pages.move_to_end((ns, h))
                self.stored += 1
            while len(self._pages) > self.capacity_pages:
                self._pages.popitem(last=False)


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


async def find_data_plane(settings: WorkerSettings) -> tuple[str, str]:
    """(this node's kv-agent, a kv-index) from the settings, else from discovery; ("", "")
    parts when not found (the cache tier is optional: the engine serves without it)."""
    from omniflow.rpc.server import registry_from_settings

    agent = settings.kv_agent_addr
    index = ""
    try:
        registry = registry_from_settings(settings)
    except Exception as exc:
        log.warning("no discovery for the kv-agent (%s)", exc)
        return agent, index
    try:
        node = settings.node_id or socket.gethostname()
        agent = await find_address(registry, "kv-agent", configured=agent, node=node)
        index = await find_address(registry, "kv-index")
    except Exception as exc:  # the cache tier is optional: serve without it
        log.warning("kv-agent / kv-index discovery failed: %s", exc)
    finally:
        await registry.close()
    return agent, index
