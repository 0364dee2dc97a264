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
from dataclasses import KW_ONLY, dataclass
from typing import TypeVar

import numpy as np

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    OmniflowError,
    Unavailable,
)
from omniflow.kv.arena import HostArena
from omniflow.kv.blocks import KVLayout, check_hash, check_namespace
from omniflow.kv.checksum import page_checksum
from omniflow.kv.pages import PageAssembler, PageData, as_bytes, page_chunks
from omniflow.kv.sources import (
    TIER_KIND,
    NoArena,
    PageSet,
    Plan,
    Source,
    SourceKind,
    TransportStats,
)
from omniflow.kv.wire import layout_to_proto, namespace_fields
from omniflow.rpc.client import open_channel
from omniflow.rpc.context import failed_call
from omniflow.rpc.interceptors import TracedChannel

__all__ = ["KVClient", "NoArena", "PageSet", "Plan", "Source", "SourceKind", "TransportStats"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(eq=False)
class KVClient:
    """One worker's view of the Data Flow layer: its node's agent and the index.

    ``device_owner_id`` is the worker's own owner id at the index (its device pool is
    reported, never fetched); at most ``max_pending_stores`` background stores run at once.
    """

    agent_address: str
    index_address: str = ""
    _: KW_ONLY
    device_owner_id: str = ""
    timeout_s: float = 10.0
    max_pending_stores: int = 64
    #: False once the arena proved unmappable here: pages then stream over gRPC.
    zero_copy: bool = True
    chunk_bytes: int = 4 * 1024 * 1024
    max_batch: int = 256

    def __post_init__(self) -> None:
        self.agent_id = ""
        self.stores_dropped = 0
        self.store_failures = 0
        self.stats = TransportStats()
        self._agent_channel: TracedChannel = open_channel(
            self.agent_address, default_timeout_s=self.timeout_s
        )
        self._agent = kvagent_pb2_grpc.KVAgentServiceStub(self._agent_channel)
        self._index_channel: TracedChannel | None = None
        self._index: kvindex_pb2_grpc.KVIndexServiceStub | None = None
        if self.index_address:
            self._index_channel = open_channel(self.index_address, default_timeout_s=self.timeout_s)
            self._index = kvindex_pb2_grpc.KVIndexServiceStub(self._index_channel)
        self._arenas: dict[str, HostArena] = {}
        self._page_bytes: dict[bytes, int] = {}  # per namespace, for streamed reads
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
        with failed_call(what, self._count_error):
            return await call

    def _count_error(self) -> None:
        self.stats.errors += 1

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

    def use_layout(self, layout: KVLayout) -> bytes:
        """Remember ``layout``'s page size (it checks writes and sizes streamed reads) with no
        call; returns its namespace."""
        self._page_bytes[layout.namespace] = layout.page_bytes
        return layout.namespace

    async def ensure_namespace(self, layout: KVLayout) -> bytes:
        """Make ``layout``'s namespace usable at the agent: registered at the index (whose
        page size must agree), or, without an index, known to the agent already."""
        ns = self.use_layout(layout)
        if self._index is None:
            # Without an index the agent can only serve a namespace someone registered.
            arena = kvagent_pb2.GetArenaRequest(**namespace_fields(ns))
            await self._call("kv agent", self._agent.GetArena(arena))
            return ns
        reply = await self._call(
            "kv index",
            self._index.RegisterNamespace(
                kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(layout))
            ),
        )
        if reply.page_bytes and reply.page_bytes != layout.page_bytes:
            raise FailedPrecondition(
                f"the index has {reply.page_bytes}-byte pages for namespace {ns.hex()}; this "
                f"layout's are {layout.page_bytes}"
            )
        return ns

    async def _agent_id(self) -> str:
        if not self.agent_id:
            reply = await self._call("kv agent", self._agent.Stats(kvagent_pb2.StatsRequest()))
            self.agent_id = reply.agent_id
        return self.agent_id

    def _arena(self, shm_name: str) -> HostArena:
        arena = self._arenas.get(shm_name)
        if arena is None:
            try:
                arena = self._arenas[shm_name] = HostArena.attach(shm_name)
            except (OmniflowError, OSError) as exc:
                raise NoArena(f"cannot map the agent's arena {shm_name!r}: {exc}") from None
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
                kvindex_pb2.MatchPrefixRequest(**namespace_fields(namespace), block_hashes=hashes)
            ),
        )
        agent_id = await self._agent_id()
        sources = []
        for o in reply.owners:
            if o.owner_id == self.device_owner_id and self.device_owner_id:
                kind = SourceKind.DEVICE
            elif o.owner_id == agent_id:
                kind = TIER_KIND.get(o.tier, SourceKind.SSD)
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
            await self._pull(namespace, hashes[: source.blocks], source, channel)
        return await self.locate(namespace, hashes, source)

    async def locate(
        self, namespace: bytes, hashes: Sequence[bytes], source: Source | None = None
    ) -> PageSet:
        """Pin the leading run of ``hashes`` the local agent holds; views into its arena."""
        hashes = list(hashes)
        reply = await self._locate(namespace, hashes)
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

    async def held(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` the local agent holds (host or SSD); nothing stays
        pinned."""
        hashes = list(hashes)
        _check(namespace, hashes)
        total = 0
        for part in _batches(hashes, self.max_batch):
            reply = await self._locate(namespace, part)
            if reply.pin_id:
                await self._unpin(reply.pin_id)
            total += len(reply.slots)
            if len(reply.slots) < len(part):
                break
        return total

    async def exists(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` that ``read`` can bring: held locally, or by another
        node's agent (per the index; without it, local ones only)."""
        hashes = list(hashes)
        local = await self.held(namespace, hashes)
        if local == len(hashes):
            return local
        try:
            plan = await self.plan(namespace, hashes)
        except OmniflowError as exc:  # the index is an accelerator
            log.info("kv index unavailable for exists (%s); local pages only", exc)
            return local
        remote = (s.blocks for s in plan.sources if s.kind == SourceKind.REMOTE)
        return max([local, *remote])

    async def read(self, namespace: bytes, hashes: Sequence[bytes]) -> list[np.ndarray]:
        """Copies (uint8) of the longest verified leading run of ``hashes``: pulled first from
        another node's agent when that one holds more; read from the arena in place, or over
        ``GetPages`` where the arena cannot be mapped. Faults end the run, never raise past
        the local agent's own answer."""
        hashes = list(hashes)
        _check(namespace, hashes)
        if not hashes:
            return []
        try:
            best = (await self.plan(namespace, hashes)).best
            if best.kind == SourceKind.REMOTE:
                await self._pull(namespace, hashes[: best.blocks], best)
        except OmniflowError as exc:
            log.info("no pull from another agent (%s); reading local pages", exc)
        out: list[np.ndarray] = []
        for part in _batches(hashes, self.max_batch):
            got = await self._read_local(namespace, part)
            out.extend(got)
            if len(got) < len(part):
                break
        self.stats.pages_got += len(out)
        return out

    async def _pull(
        self, namespace: bytes, hashes: list[bytes], source: Source, channel: str = ""
    ) -> None:
        reply = await self._call(
            f"pull from {source.address}",
            self._agent.PullPages(
                kvagent_pb2.PullPagesRequest(
                    **namespace_fields(namespace),
                    block_hashes=hashes,
                    source_address=source.address,
                    source_owner=source.owner_id,
                    channel=channel,
                )
            ),
        )
        self.stats.pages_pulled += reply.pulled
        self.stats.checksum_failures += reply.checksum_failures
        if reply.checksum_failures:
            log.warning("%d pulled pages failed their checksum", reply.checksum_failures)

    async def _locate(
        self, namespace: bytes, hashes: list[bytes]
    ) -> kvagent_pb2.LocatePagesResponse:
        return await self._call(
            "kv agent",
            self._agent.LocatePages(
                kvagent_pb2.LocatePagesRequest(**namespace_fields(namespace), block_hashes=hashes)
            ),
        )

    async def _read_local(self, namespace: bytes, hashes: list[bytes]) -> list[np.ndarray]:
        if self.zero_copy:
            try:
                return await self._read_in_place(namespace, hashes)
            except NoArena as exc:  # not on the agent's node: stream from now on
                log.info("%s; streaming pages", exc)
                self.zero_copy = False
        return await self._read_streamed(namespace, hashes)

    async def _read_in_place(self, namespace: bytes, hashes: list[bytes]) -> list[np.ndarray]:
        reply = await self._locate(namespace, hashes)
        if not reply.slots:
            return []
        out: list[np.ndarray] = []
        try:
            arena = self._arena(reply.shm_name)
            for ref in reply.slots:
                page = arena.view(ref.slot).copy()  # copy out, then the pin may go
                if page_checksum(page) != ref.checksum:
                    self.stats.checksum_failures += 1
                    break
                out.append(page)
        finally:
            await self._unpin(reply.pin_id)
        self.stats.zero_copy_gets += len(out)
        return out

    async def _page_bytes_of(self, namespace: bytes) -> int:
        pb = self._page_bytes.get(namespace)
        if pb is None:
            arena = await self._call(
                "kv agent",
                self._agent.GetArena(kvagent_pb2.GetArenaRequest(**namespace_fields(namespace))),
            )
            pb = self._page_bytes[namespace] = arena.page_bytes
        return pb

    async def _read_streamed(self, namespace: bytes, hashes: list[bytes]) -> list[np.ndarray]:
        asm = PageAssembler(hashes, await self._page_bytes_of(namespace))
        call = self._agent.GetPages(
            kvagent_pb2.GetPagesRequest(
                **namespace_fields(namespace), block_hashes=hashes, chunk_bytes=self.chunk_bytes
            )
        )
        with failed_call("kv agent GetPages", self._count_error):
            async for chunk in call:
                asm.feed(chunk)
        self.stats.checksum_failures += asm.checksum_failures
        self.stats.streamed_gets += len(asm.pages)
        return [np.frombuffer(p, dtype=np.uint8) for p in asm.pages]

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
        pages: Sequence[PageData],
    ) -> int:
        """Store pages in the local agent's host tier in place; returns pages committed
        (pages it held already are skipped). Zero-copy path: reserve, write, commit."""
        hashes = list(hashes)
        _check(namespace, hashes)
        _, committed = await self._put_in_place(namespace, hashes, pages)
        return committed

    async def write(
        self, namespace: bytes, hashes: Sequence[bytes], pages: Sequence[PageData]
    ) -> int:
        """Store pages (contract byte order) at the local agent, in place where its arena maps
        here, else over ``PutPages``; returns how many of them it now holds (stored now or
        before). Raises on a transport fault or a page of the wrong size."""
        hashes = list(hashes)
        _check(namespace, hashes)
        if len(hashes) != len(pages):
            raise InvalidArgument(f"{len(hashes)} hashes but {len(pages)} pages")
        want = self._page_bytes.get(namespace)
        for i, p in enumerate(pages):
            if want is not None and len(as_bytes(p)) != want:
                raise InvalidArgument(f"page {i} is {len(as_bytes(p))} bytes; pages are {want}")
        held = 0
        for start in range(0, len(hashes), self.max_batch):
            hs = hashes[start : start + self.max_batch]
            ps = pages[start : start + self.max_batch]
            held += await self._write_batch(namespace, hs, ps)
        self.stats.pages_put += held
        return held

    async def _write_batch(
        self, namespace: bytes, hashes: list[bytes], pages: Sequence[PageData]
    ) -> int:
        if self.zero_copy:
            try:
                already, committed = await self._put_in_place(namespace, hashes, pages)
                return already + committed
            except NoArena as exc:  # not on the agent's node: stream from now on
                log.info("%s; streaming pages", exc)
                self.zero_copy = False
        stream = page_chunks(namespace, hashes, pages, self.chunk_bytes)
        reply = await self._call("kv agent PutPages", self._agent.PutPages(stream))
        if reply.rejected:
            self.stats.checksum_failures += reply.rejected
            raise DataLoss(
                f"the agent rejected {reply.rejected} pages: {'; '.join(reply.errors)[:300]}"
            )
        self.stats.streamed_puts += reply.stored
        # PutPages counts what it stored; pages it held already are not errors.
        return len(hashes)

    async def _put_in_place(
        self, namespace: bytes, hashes: list[bytes], pages: Sequence[PageData]
    ) -> tuple[int, int]:
        """(pages the agent held already, pages committed now): reserve, write, commit."""
        ns = namespace_fields(namespace)
        reply = await self._call(
            "kv agent reserve",
            self._agent.CommitPages(kvagent_pb2.CommitPagesRequest(**ns, reserve_hashes=hashes)),
        )
        already = len(reply.already_held)
        if not reply.reservations:
            return already, 0
        by_hash = dict(zip(hashes, pages, strict=True))
        refs = []
        try:
            arena = self._arena(reply.shm_name)
            for res in reply.reservations:
                src = np.frombuffer(as_bytes(by_hash[res.block_hash]), np.uint8)
                if src.size != arena.page_bytes:
                    raise InvalidArgument(
                        f"page {res.block_hash.hex()} is {src.size} bytes; the namespace's pages "
                        f"are {arena.page_bytes}"
                    )
                np.copyto(arena.view(res.slot), src)
                refs.append(
                    kvagent_pb2.SlotRef(
                        block_hash=res.block_hash, slot=res.slot, checksum=page_checksum(src)
                    )
                )
        except BaseException:
            with contextlib.suppress(OmniflowError):  # reservations lapse on their own
                await self._call(
                    "kv agent abort",
                    self._agent.CommitPages(
                        kvagent_pb2.CommitPagesRequest(
                            **ns, abort_slots=[r.slot for r in reply.reservations]
                        )
                    ),
                )
            raise
        done = await self._call(
            "kv agent commit",
            self._agent.CommitPages(kvagent_pb2.CommitPagesRequest(**ns, slots=refs)),
        )
        if done.checksum_failures:
            self.stats.checksum_failures += done.checksum_failures
            raise DataLoss(f"{done.checksum_failures} pages changed before their commit")
        self.stats.zero_copy_puts += done.committed
        return already, done.committed


def _batches(items: list[bytes], size: int) -> list[list[bytes]]:
    return [items[i : i + size] for i in range(0, len(items), max(1, size))]


def _check(namespace: bytes, hashes: Sequence[bytes]) -> None:
    check_namespace(namespace)
    for i, h in enumerate(hashes):
        check_hash(h, f"hash {i}")
