"""The Data Flow client for workers: find KV pages, bring them to this node, read in place.

``KVClient.acquire(namespace, hashes)``:

1. asks the index (``MatchPrefix``) who holds the leading blocks of the chain;
2. picks the cheapest source: the worker's own device pool (reported, not fetched: the
   engine already holds those pages) > the local agent's host tier > its SSD tier > a
   remote agent (only when it holds a longer prefix than the local agent);
3. for a remote source, has the local agent pull the pages (``PullPages``: agent to
   agent, over NIXL or gRPC, checksummed) into its host tier;
4. pins the leading run locally (``LocatePages``) and returns ``PageSet``: one numpy view
   per page, straight into the node's shared-memory arena (zero copy); ``release`` unpins.

``KVClient.store(namespace, hashes, pages)`` writes pages through to the local agent in a
background task (reserve slots, copy in place, commit with checksums): the caller never
waits. Everything that goes wrong surfaces as an ``omniflow.errors`` error (never a gRPC
one) that the caller answers by recomputing; a miss is an empty ``PageSet``, not an error.
The index is an accelerator: without it the client still reads what the local agent holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import grpc
import numpy as np

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import DataLoss, InvalidArgument, OmniflowError, Unavailable
from omniflow.kv.arena import HostArena
from omniflow.kv.blocks import HASH_BYTES, KVLayout
from omniflow.kv.checksum import page_checksum
from omniflow.kv.wire import layout_to_proto
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.rpc.status import error_from_rpc

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class SourceKind(StrEnum):
    DEVICE = "device"  # the caller's own device pool
    HOST = "host"  # the local agent's shared-memory tier
    SSD = "ssd"  # the local agent's SSD tier
    REMOTE = "remote"  # another node's agent
    NONE = "none"


_TIER_KIND = {1: SourceKind.DEVICE, 2: SourceKind.HOST, 3: SourceKind.SSD}


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
    _client: KVClient | None = field(default=None, repr=False)

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


class KVClient:
    """One worker's view of the Data Flow layer: its node's agent and the index."""

    def __init__(
        self,
        agent_address: str,
        index_address: str = "",
        *,
        device_owner_id: str = "",
        timeout_s: float = 10.0,
        max_pending_stores: int = 64,
    ) -> None:
        self.agent_address = agent_address
        self.index_address = index_address
        self.device_owner_id = device_owner_id
        self.timeout_s = timeout_s
        self.max_pending_stores = max_pending_stores
        self.agent_id = ""
        self.stores_dropped = 0
        self.store_failures = 0
        self._agent_channel: TracedChannel = open_channel(
            agent_address, default_timeout_s=timeout_s
        )
        self._agent = kvagent_pb2_grpc.KVAgentServiceStub(self._agent_channel)
        self._index_channel: TracedChannel | None = None
        self._index: kvindex_pb2_grpc.KVIndexServiceStub | None = None
        if index_address:
            self._index_channel = open_channel(index_address, default_timeout_s=timeout_s)
            self._index = kvindex_pb2_grpc.KVIndexServiceStub(self._index_channel)
        self._arenas: dict[str, HostArena] = {}
        self._pending: set[asyncio.Task[int]] = set()

    async def close(self) -> None:
        """Wait for background stores, unmap arenas, close channels."""
        await self.flush()
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        await self._agent_channel.close()
        if self._index_channel is not None:
            await self._index_channel.close()

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- calls ------------------------------------------------------------------------------

    async def _call(self, what: str, call: Awaitable[_T]) -> _T:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc)
            raise type(err)(f"{what}: {err}") from None

    async def register_namespace(self, layout: KVLayout) -> bytes:
        """Register ``layout`` at the index (idempotent); returns its namespace."""
        if self._index is None:
            raise Unavailable("no kv-index address given to this client")
        await self._call(
            "kv index",
            self._index.RegisterNamespace(
                kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(layout))
            ),
        )
        return layout.namespace

    async def _agent_id(self) -> str:
        if not self.agent_id:
            reply = await self._call("kv agent", self._agent.Stats(kvagent_pb2.StatsRequest()))
            self.agent_id = reply.agent_id
        return self.agent_id

    def _arena(self, shm_name: str) -> HostArena:
        arena = self._arenas.get(shm_name)
        if arena is None:
            arena = self._arenas[shm_name] = HostArena.attach(shm_name)
        return arena

    # --- reading ----------------------------------------------------------------------------

    async def plan(self, namespace: bytes, hashes: Sequence[bytes]) -> Plan:
        """Rank the holders of the chain's leading blocks (one MatchPrefix)."""
        _check(namespace, hashes)
        if self._index is None or not hashes:
            return Plan((), 0)
        reply = await self._call(
            "kv index",
            self._index.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(namespace=namespace.hex(), block_hashes=hashes)
            ),
        )
        agent_id = await self._agent_id()
        sources = []
        for o in reply.owners:
            if o.owner_id == self.device_owner_id and self.device_owner_id:
                kind = SourceKind.DEVICE
            elif o.owner_id == agent_id:
                kind = _TIER_KIND.get(o.tier, SourceKind.SSD)
            elif o.kind == kvindex_pb2.OWNER_KIND_AGENT:
                kind = SourceKind.REMOTE
            else:
                continue  # another worker's device pool: not reachable through agents
            sources.append(Source(kind, o.matched_blocks, o.owner_id, o.address))
        cost = list(SourceKind).index
        # More blocks first; among equals, the cheaper tier. A remote source wins only if
        # it holds strictly more than every local one.
        sources.sort(key=lambda s: (-s.blocks, cost(s.kind)))
        return Plan(tuple(sources), reply.longest_prefix)

    async def acquire(
        self, namespace: bytes, hashes: Sequence[bytes], *, channel: str = ""
    ) -> PageSet:
        """Pin the longest leading run of ``hashes`` available to this node, pulling it from a
        remote agent first if that one holds more. Pages the caller's device pool holds are
        not fetched: ``source.kind`` is DEVICE and the set is empty for them.
        """
        hashes = list(hashes)
        _check(namespace, hashes)
        source = Source(SourceKind.NONE, 0)
        try:
            source = (await self.plan(namespace, hashes)).best
        except Unavailable as exc:  # the index is an accelerator: read what is local
            log.info("kv index unavailable (%s); reading the local agent only", exc)
        if source.kind == SourceKind.DEVICE:
            return PageSet(namespace, [], [], [], source)
        if source.kind == SourceKind.REMOTE:
            reply = await self._call(
                f"pull from {source.address}",
                self._agent.PullPages(
                    kvagent_pb2.PullPagesRequest(
                        namespace=namespace.hex(),
                        block_hashes=hashes[: source.blocks],
                        source_address=source.address,
                        source_owner=source.owner_id,
                        channel=channel,
                    )
                ),
            )
            if reply.checksum_failures:
                log.warning("%d pulled pages failed their checksum", reply.checksum_failures)
        return await self.locate(namespace, hashes, source)

    async def locate(
        self, namespace: bytes, hashes: Sequence[bytes], source: Source | None = None
    ) -> PageSet:
        """Pin the leading run of ``hashes`` the local agent holds; views into its arena."""
        hashes = list(hashes)
        reply = await self._call(
            "kv agent",
            self._agent.LocatePages(
                kvagent_pb2.LocatePagesRequest(namespace=namespace.hex(), block_hashes=hashes)
            ),
        )
        if not reply.slots:
            return PageSet(namespace, [], [], [], source or Source(SourceKind.NONE, 0))
        try:
            arena = self._arena(reply.shm_name)
            views = [arena.view(ref.slot) for ref in reply.slots]
        except OmniflowError:
            await self._unpin(reply.pin_id)
            raise
        if source is None or source.kind in (SourceKind.NONE, SourceKind.REMOTE):
            kind = SourceKind.SSD if any(r.found_in == 3 for r in reply.slots) else SourceKind.HOST
            source = Source(kind, len(views), self.agent_id, self.agent_address)
        return PageSet(
            namespace,
            hashes[: len(views)],
            views,
            [ref.checksum for ref in reply.slots],
            source,
            reply.pin_id,
            self,
        )

    async def _unpin(self, pin_id: str) -> None:
        try:
            await self._call(
                "kv agent unpin", self._agent.Unpin(kvagent_pb2.UnpinRequest(pin_id=pin_id))
            )
        except OmniflowError as exc:  # the pin lapses on its own
            log.info("%s", exc)

    # --- writing ----------------------------------------------------------------------------

    def store(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        pages: Sequence[bytes | bytearray | memoryview | np.ndarray],
    ) -> asyncio.Task[int] | None:
        """Write full pages through to the local agent in the background (never waits).

        Returns the task (its result: pages committed), or None when too many stores are
        pending already and this one is dropped (counted in ``stores_dropped``).
        """
        _check(namespace, hashes)
        if len(hashes) != len(pages):
            raise InvalidArgument(f"{len(hashes)} hashes but {len(pages)} pages")
        if len(self._pending) >= self.max_pending_stores:
            self.stores_dropped += 1
            return None
        task = asyncio.create_task(self.put(namespace, list(hashes), list(pages)))
        self._pending.add(task)
        task.add_done_callback(self._store_done)
        return task

    def _store_done(self, task: asyncio.Task[int]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.store_failures += 1
            log.warning("kv write-through failed (pages stay local): %s", task.exception())

    async def flush(self) -> None:
        """Wait for every background store (their failures are counted, not raised)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def put(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        pages: Sequence[bytes | bytearray | memoryview | np.ndarray],
    ) -> int:
        """Store pages in the local agent's host tier in place; returns pages committed
        (pages it held already are skipped). Zero-copy path: reserve, write, commit."""
        hashes = list(hashes)
        _check(namespace, hashes)
        ns = namespace.hex()
        reply = await self._call(
            "kv agent reserve",
            self._agent.CommitPages(
                kvagent_pb2.CommitPagesRequest(namespace=ns, reserve_hashes=hashes)
            ),
        )
        if not reply.reservations:
            return 0
        by_hash = dict(zip(hashes, pages, strict=True))
        refs = []
        try:
            arena = self._arena(reply.shm_name)
            for res in reply.reservations:
                data = by_hash[res.block_hash]
                src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
                src = src.reshape(-1).view(np.uint8)
                if src.size != arena.page_bytes:
                    raise InvalidArgument(
                        f"page {res.block_hash.hex()} is {src.size} bytes; the namespace's pages "
                        f"are {arena.page_bytes}"
                    )
                view = arena.view(res.slot)
                np.copyto(view, src)
                refs.append(
                    kvagent_pb2.SlotRef(
                        block_hash=res.block_hash, slot=res.slot, checksum=page_checksum(src)
                    )
                )
        except BaseException:
            with contextlib.suppress(OmniflowError):
                await self._call(
                    "kv agent abort",
                    self._agent.CommitPages(
                        kvagent_pb2.CommitPagesRequest(
                            namespace=ns, abort_slots=[r.slot for r in reply.reservations]
                        )
                    ),
                )
            raise
        done = await self._call(
            "kv agent commit",
            self._agent.CommitPages(kvagent_pb2.CommitPagesRequest(namespace=ns, slots=refs)),
        )
        if done.checksum_failures:
            raise DataLoss(f"{done.checksum_failures} pages changed before their commit")
        return done.committed


def _check(namespace: bytes, hashes: Sequence[bytes]) -> None:
    if len(namespace) != HASH_BYTES:
        raise InvalidArgument(f"namespace must be {HASH_BYTES} bytes, got {len(namespace)}")
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise InvalidArgument(f"hash {i} has {len(h)} bytes; block hashes are {HASH_BYTES}")
