"""Asynchronous prefix loads from the KV connector (host tier, SSD, another node's agent).

A request whose prefix the device pool lacks but the data plane may hold waits here, in its
own state, while its pages are fetched on a thread of this module; the engine keeps stepping
the rest of the batch (as vLLM v1 parks such requests in WAITING_FOR_REMOTE_KVS). When the
fetch finishes, the request joins the scheduler's queue with the fetched pages attached, and
admission imports them into the pool (one copy per page).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from omniflow.kv.blocks import KVLayout
from omniflow_services.worker.llm.connector import KVConnector

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FetchedPages:
    """Pages fetched for block indices ``[start, start + len(blobs))`` of a request."""

    start: int
    blobs: list[bytes]
    failed: bool = False


@dataclass(slots=True)
class _Load:
    seq: object
    start: int
    future: Future[list[bytes]]


class KVLoads:
    """Fetches in flight, one per waiting request, on a small thread pool."""

    def __init__(self, connector: KVConnector, layout: KVLayout, threads: int = 2) -> None:
        self._connector = connector
        self._layout = layout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kv-load")
        self._loads: list[_Load] = []
        self.started = 0
        self.failures = 0

    @property
    def connector(self) -> KVConnector:
        return self._connector

    def __len__(self) -> int:
        return len(self._loads)

    def start(self, seq: object, hashes: list[bytes], start: int) -> None:
        """Fetch the pages of ``hashes`` (block indices from ``start``) for ``seq``."""
        fut = self._pool.submit(self._connector.fetch_pages, self._layout, hashes)
        self._loads.append(_Load(seq, start, fut))
        self.started += 1

    def wait(self, timeout_s: float) -> None:
        """Block until some fetch finishes or ``timeout_s`` passes (nothing else to do)."""
        if self._loads:
            wait([ld.future for ld in self._loads], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def collect(self, deliver: Callable[[object, FetchedPages], None]) -> None:
        """Hand every finished fetch to ``deliver`` (a failed one as no pages: recompute)."""
        pending: list[_Load] = []
        want = self._layout.page_bytes
        for ld in self._loads:
            if not ld.future.done():
                pending.append(ld)
                continue
            try:
                blobs = list(ld.future.result())
                bad = next((i for i, b in enumerate(blobs) if len(b) != want), None)
                if bad is not None:
                    raise ValueError(
                        f"connector page {bad} has {len(blobs[bad])} bytes, want {want}"
                    )
            except Exception as exc:  # any connector fault means recompute
                self.failures += 1
                log.warning("KV connector fetch failed, recomputing: %s", exc)
                deliver(ld.seq, FetchedPages(ld.start, [], failed=True))
                continue
            deliver(ld.seq, FetchedPages(ld.start, blobs))
        self._loads = pending

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
