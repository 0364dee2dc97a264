"""The page protocol for callers without an event loop: a blocking face on ``KVClient``.

Engines call their KV storage from their own threads, synchronously (SGLang's HiCache
storage backend from its prefetch/backup threads, vLLM's KV connector from its worker, the
built-in engine's connector). ``LoopThread`` runs an event loop on a private thread;
``AgentPageStore`` runs one ``KVClient`` there, so the protocol with the agent and the index
(zero-copy arena reads and writes, the ``GetPages``/``PutPages`` streams where the arena
cannot be mapped, pulls from other nodes, checksums) has one implementation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import numpy as np

from omniflow.errors import DeadlineExceeded, InvalidArgument
from omniflow.kv.blocks import KVLayout
from omniflow.kv.client import KVClient, TransportStats
from omniflow.kv.pages import PageData

_T = TypeVar("_T")


def agent_settings(extra: Mapping[str, Any], what: str) -> tuple[str, str, float]:
    """``(agent_address, index_address, timeout_s)`` of an engine's extra config (SGLang's
    HiCache, vLLM's connector), which an ``AgentPageStore`` is opened with; InvalidArgument
    naming ``what`` and the field when one is missing or bad."""
    agent = str(extra.get("agent_address", ""))
    if not agent:
        raise InvalidArgument(f"{what} needs agent_address (this node's kv-agent, host:port)")
    raw = extra.get("timeout_s", 10.0)
    try:
        timeout = float(raw)
    except (TypeError, ValueError):
        timeout = 0.0
    if not timeout > 0:
        raise InvalidArgument(f"{what}: timeout_s must be a number > 0, got {raw!r}")
    return agent, str(extra.get("index_address", "")), timeout


class LoopThread:
    """An asyncio event loop on a daemon thread of its own, for blocking callers."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Schedule ``coro`` on the loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """Run ``coro`` on the loop and wait for its result (DeadlineExceeded after
        ``timeout_s``; the coroutine is cancelled then)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            fut.cancel()
            raise DeadlineExceeded(f"no answer within {timeout_s} s") from None

    def stop(self) -> None:
        """Stop the loop and join its thread (after the caller closed what runs on it)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class AgentPageStore:
    """Pages of one namespace at the node's kv-agent (and the index, when given), blocking.

    Thread-safe: calls from several threads run concurrently on the store's loop."""

    def __init__(
        self,
        agent_address: str,
        layout: KVLayout,
        *,
        index_address: str = "",
        timeout_s: float = 10.0,
        zero_copy: bool = True,
        chunk_bytes: int = 4 * 1024 * 1024,
        max_batch: int = 256,
    ) -> None:
        if not agent_address:
            raise InvalidArgument("agent_address (this node's kv-agent) is required")
        self.layout = layout
        self.namespace = layout.namespace
        self.index_address = index_address
        self.timeout_s = timeout_s
        self._loop = LoopThread("kv-page-store")

        async def make() -> KVClient:  # its channels belong to the loop that creates them
            client = KVClient(
                agent_address,
                index_address,
                timeout_s=timeout_s,
                zero_copy=zero_copy,
                chunk_bytes=chunk_bytes,
                max_batch=max_batch,
            )
            client.use_layout(layout)
            return client

        self.client: KVClient = self._loop.run(make(), timeout_s)

    @property
    def stats(self) -> TransportStats:
        return self.client.stats

    def _run(self, coro: Coroutine[Any, Any, _T], calls: int = 1) -> _T:
        # Each call inside has its own deadline; this bound only catches a stuck loop.
        return self._loop.run(coro, self.timeout_s * (2 + calls))

    def _calls(self, n: int) -> int:
        return 2 + -(-n // max(1, self.client.max_batch)) * 3

    def register(self) -> None:
        """Make the namespace known to the index (the agent learns page sizes from it)."""
        self._run(self.client.ensure_namespace(self.layout))

    def local_count(self, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` the local agent holds (host or SSD)."""
        return self._run(self.client.held(self.namespace, hashes), self._calls(len(hashes)))

    def exists(self, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` that ``get`` can bring (local, or pulled)."""
        return self._run(self.client.exists(self.namespace, hashes), self._calls(len(hashes)))

    def get(self, hashes: Sequence[bytes]) -> list[np.ndarray]:
        """The verified bytes of the longest leading run of ``hashes`` (copies, uint8)."""
        return self._run(self.client.read(self.namespace, hashes), self._calls(len(hashes)))

    def put(self, hashes: Sequence[bytes], pages: Sequence[PageData]) -> int:
        """Store pages (contract byte order) at the local agent; returns how many the agent
        now holds of them (stored now or before). Raises on a transport fault."""
        return self._run(self.client.write(self.namespace, hashes, pages), self._calls(len(hashes)))

    def close(self) -> None:
        try:
            self._run(self.client.close())
        finally:
            self._loop.stop()
