"""vLLM's device blocks in the kv-index, under the worker's own lease.

vLLM publishes what its block pool caches and evicts as KV events (``kv_events_config``:
``BlockStored`` with the blocks' token ids and parent, ``BlockRemoved``,
``AllBlocksCleared``) on a ZMQ PUB socket, msgpack-encoded ``KVEventBatch`` items
(vllm 0.32: ``vllm/distributed/kv_events.py``). ``DeviceIndex`` subscribes, renames each
vLLM block to the Omni-Flow block hashes of its pages (the same chain the connector stores
pages under) and feeds them to an ``IndexLink`` with the worker's instance id as owner, so
the router's ``kv_aware`` strategy sees which pages sit in this worker's device pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omniflow.api.kvindex.v1 import kvindex_pb2
from omniflow.errors import Unavailable
from omniflow.kv.blocks import ROOT_PARENT, KVLayout, extend_chain
from omniflow.kv.events import BlockEntry, Tier
from omniflow.kv.index_link import IndexLink
from omniflow.rpc.server import Runtime
from omniflow_services.worker.kv import DeviceEvents

log = logging.getLogger(__name__)

TOPIC = "omniflow"


def events_endpoint() -> str:
    """A private IPC endpoint for one worker's vLLM KV events."""
    folder = Path(tempfile.gettempdir())
    return f"ipc://{folder}/omniflow-vllm-kv-events-{os.getpid()}"


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` that publishes to ``endpoint``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": TOPIC,
    }


class BlockNames:
    """vLLM block hash → the Omni-Flow block hashes of its pages (pure; no vLLM needed)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.pages: dict[Any, list[bytes]] = {}  # vLLM hash -> our hashes of its pages

    def stored(self, parent: Any, blocks: list[Any], tokens: list[int], size: int) -> list[bytes]:
        """Name ``blocks`` (each ``size`` tokens of ``tokens``, the first after ``parent``);
        returns the new page hashes. A block whose parent we never saw is skipped: its
        chain cannot be named (it was cached before we subscribed)."""
        if parent is None:
            last = ROOT_PARENT
        elif self.pages.get(parent):
            last = self.pages[parent][-1]
        else:
            return []
        page, ns = self.layout.page_size, self.layout.namespace
        if size <= 0 or size % page:
            return []
        out: list[bytes] = []
        for i, vh in enumerate(blocks):
            mine = extend_chain([], ns, tokens[i * size : (i + 1) * size], page, parent=last)
            if len(mine) < size // page:
                break  # fewer tokens than the event's blocks claim: name no partial page
            last = mine[-1]
            self.pages[vh] = mine
            out.extend(mine)
        return out

    def removed(self, blocks: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        for vh in blocks:
            out.extend(self.pages.pop(vh, ()))
        return out

    def cleared(self) -> list[bytes]:
        out = [h for hs in self.pages.values() for h in hs]
        self.pages.clear()
        return out

    def held(self) -> list[bytes]:
        return [h for hs in self.pages.values() for h in hs]


class DeviceIndex:
    """Subscribes to vLLM's KV events and announces the device pages in the index."""

    def __init__(self, endpoint: str, layout: KVLayout) -> None:
        self.endpoint = endpoint
        self.layout = layout
        self.names = BlockNames(layout)
        self.events = DeviceEvents()
        self.link: IndexLink | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, runtime: Runtime, find_index: Callable[[], Any]) -> None:
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

        def entries() -> list[BlockEntry]:
            with self._lock:
                held = self.names.held()
            return [BlockEntry(self.layout.namespace, h, Tier.DEVICE) for h in held]

        self.link = IndexLink(
            runtime.instance_id,
            runtime.node,
            runtime.address,
            find_index,
            self.events.drain,
            entries,
            kind=kvindex_pb2.OWNER_KIND_WORKER,
        )
        self.link.start()
        self.events.notify = self.link.wake

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.connect(self.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        try:
            while not self._stop.is_set():
                if not sub.poll(200):
                    continue
                _, _, payload = sub.recv_multipart()
                batch = decoder.decode(payload)
                for ev in batch.events:
                    with self._lock:
                        if isinstance(ev, BlockStored):
                            new = self.names.stored(
                                ev.parent_block_hash, ev.block_hashes, ev.token_ids, ev.block_size
                            )
                            self.events.publish(self.layout, new, [])
                        elif isinstance(ev, BlockRemoved):
                            self.events.publish(
                                self.layout, [], self.names.removed(ev.block_hashes)
                            )
                        elif isinstance(ev, AllBlocksCleared):
                            self.events.publish(self.layout, [], self.names.cleared())
        except Exception as exc:  # the index is an accelerator: serve on without it
            log.warning("vLLM KV events stopped (%s): device pages no longer announced", exc)
        finally:
            sub.close(linger=0)

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2.0)
        if self.link is not None:
            with contextlib.suppress(Unavailable):
                await self.link.stop()
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://") :])
            await asyncio.to_thread(path.unlink, missing_ok=True)
