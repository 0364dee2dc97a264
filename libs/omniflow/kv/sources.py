"""What a ``KVClient`` answers with: ranked sources of a chain's pages and pinned page sets.

Kept apart from the client so that callers (the engines' connectors, the tests) name these
types without the client's transport code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import numpy as np

from omniflow.errors import DataLoss, FailedPrecondition
from omniflow.kv.checksum import page_checksum


class _Unpins(Protocol):
    async def _unpin(self, pin_id: str) -> None: ...


class SourceKind(StrEnum):
    DEVICE = "device"  # the caller's own device pool
    HOST = "host"  # the local agent's shared-memory tier
    SSD = "ssd"  # the local agent's SSD tier
    REMOTE = "remote"  # another node's agent
    NONE = "none"


TIER_KIND = {1: SourceKind.DEVICE, 2: SourceKind.HOST, 3: SourceKind.SSD}


class NoArena(FailedPrecondition):
    """The agent's shared-memory arena cannot be mapped here (another node or container)."""


@dataclass(slots=True)
class TransportStats:
    """Page traffic of one client since start (``read``/``write`` and the streams)."""

    pages_put: int = 0
    pages_got: int = 0
    pages_pulled: int = 0
    checksum_failures: int = 0
    zero_copy_puts: int = 0
    streamed_puts: int = 0
    zero_copy_gets: int = 0
    streamed_gets: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class Source:
    """Where the leading ``blocks`` of a chain can be had from, cheapest first."""

    kind: SourceKind
    blocks: int
    owner_id: str = ""
    address: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """The index's answer, ranked: ``best`` is what ``acquire`` will use."""

    sources: tuple[Source, ...]
    longest_prefix: int

    @property
    def best(self) -> Source:
        return self.sources[0] if self.sources else Source(SourceKind.NONE, 0)


@dataclass(slots=True)
class PageSet:
    """Pinned pages in the local arena. ``views[i]`` is page ``i`` of the chain, in place.

    The views are valid until ``release`` (or the agent's pin TTL); copy what must outlive
    it. Use as an async context manager, or call ``release`` once.
    """

    namespace: bytes
    hashes: list[bytes]
    views: list[np.ndarray]
    checksums: list[int]
    source: Source
    pin_id: str = ""
    _client: _Unpins | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.views)

    def verify(self) -> None:
        """Check every page against its checksum (DataLoss on the first mismatch)."""
        for h, view, want in zip(self.hashes, self.views, self.checksums, strict=True):
            if page_checksum(view) != want:
                raise DataLoss(f"page {h.hex()} changed in the arena; recompute")

    async def release(self) -> None:
        client, self._client = self._client, None
        self.views = []
        if client is not None and self.pin_id:
            await client._unpin(self.pin_id)

    async def __aenter__(self) -> PageSet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
