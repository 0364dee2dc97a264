"""The worker's link to the Data Flow layer.

- ``AgentConnector`` (the engine's KVConnector): on a device-pool miss the engine gets
  pages from this node's kv-agent — its host or SSD tier, or pulled from a remote agent
  the index names — and full pages are written through to the agent off the step.
- ``DeviceEvents`` (the engine's BlockEventSink) + an ``IndexLink``: the device pool's
  stored/removed blocks are announced in the index under the worker's own lease, so the
  router's KV-aware strategy sees them.

Without a kv-agent on the node the worker runs alone (recompute on a device miss) and
keeps looking for one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from omniflow.api.kvindex.v1 import kvindex_pb2
from omniflow.discovery import find_address
from omniflow.errors import Unavailable
from omniflow.kv.blocks import KVLayout
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind, Tier
from omniflow.kv.index_link import IndexLink
from omniflow.rpc.server import Runtime
from omniflow.tasks import stop_task
from omniflow_services.worker.llm.connector import AgentConnector

log = logging.getLogger(__name__)

RETRY_S = 2.0


class DeviceEvents:
    """Collects the engine's device-pool events (engine thread) for the index link (loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[BlockEvent] = []
        #: Called when events are queued (the index link's ``wake``).
        self.notify: Callable[[], None] | None = None

    def publish(self, layout: KVLayout, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        ns = layout.namespace
        new = [BlockEvent(EventKind.STORED, ns, h, Tier.DEVICE) for h in stored]
        new += [BlockEvent(EventKind.REMOVED, ns, h, Tier.DEVICE) for h in removed]
        with self._lock:
            self._events.extend(new)
        if new and self.notify is not None:
            self.notify()  # from the engine's step thread: IndexLink.wake is thread-safe

    def drain(self) -> list[BlockEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out


class WorkerKV:
    """Attaches an engine to the node's kv-agent and to the index; retries until both answer."""

    def __init__(self, runtime: Runtime, agent_address: str = "", index_address: str = "") -> None:
        self.runtime = runtime
        self.agent_address = agent_address
        self.index_address = index_address
        self.connector: AgentConnector | None = None
        self.link: IndexLink | None = None
        self._task: asyncio.Task[None] | None = None

    async def _find(self, service: str, same_node: bool) -> str:
        rt = self.runtime
        return await find_address(rt.registry, service, node=rt.node, same_node=same_node)

    async def _find_index(self) -> str:
        return self.index_address or await self._find("kv-index", same_node=False)

    def attach(self, engine: Any) -> None:
        """Start attaching ``engine`` in the background (the worker serves meanwhile)."""
        self._task = asyncio.create_task(self._attach(engine), name="worker-kv-attach")

    async def _attach(self, engine: Any) -> None:
        while True:
            try:
                agent = self.agent_address or await self._find("kv-agent", same_node=True)
                try:
                    index = await self._find_index()
                except Unavailable:
                    index = ""  # the agent alone still serves this node's pages
                connector = await asyncio.to_thread(
                    AgentConnector, agent, index, device_owner_id=self.runtime.instance_id
                )
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("kv-agent not attached yet (%s); retrying in %.0fs", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)
        events = DeviceEvents()
        self.connector = connector
        engine.connector, engine.events = connector, events

        def entries() -> list[BlockEntry]:
            ns = engine.layout.namespace
            return [BlockEntry(ns, h, Tier.DEVICE) for h in engine.cache.cached_hashes()]

        self.link = IndexLink(
            self.runtime.instance_id,
            self.runtime.node,
            self.runtime.address,
            self._find_index,
            events.drain,
            entries,
            kind=kvindex_pb2.OWNER_KIND_WORKER,
        )
        self.link.start()
        events.notify = self.link.wake
        log.info("KV attached: agent %s, index %s", agent, index or "(none yet)")

    async def wait_stored(self, hashes: Sequence[bytes], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the agent acknowledged the write-through of
        every page of ``hashes`` this worker still had in flight. False: not attached to an
        agent, a store dropped or failed, or the deadline passed; the pages may be missing."""
        if self.connector is None:
            return False
        futures = [asyncio.wrap_future(f) for f in self.connector.pending_writes(hashes)]
        if not futures:
            return True
        # No cancel on timeout: a wrapper's cancel would cancel the store itself.
        done, pending = await asyncio.wait(futures, timeout=timeout_s)
        return not pending and all(
            not f.cancelled() and f.exception() is None and f.result() for f in done
        )

    async def stop(self) -> None:
        await stop_task(self._task)
        if self.link is not None:
            await self.link.stop()
        if self.connector is not None:
            await asyncio.to_thread(self.connector.close)
