"""The hook between the engine's device pool and the data plane (DESIGN.md §4.3).

On a prefix miss in the device pool the engine asks a ``KVConnector`` for pages by block
hash and writes newly computed full pages through to it. Page bytes are in the KVLayout byte
order of ``KVPool`` (K then V; layer, head, token, dim). The Data Flow client implements the
protocol for the node agent; ``MemoryConnector`` is a real in-process implementation (pages
exported by one engine served to another in the same process).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from omniflow.kv.blocks import KVLayout


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
