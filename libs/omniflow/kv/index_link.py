"""An owner's link to the KV index: lease, heartbeats, event batches, snapshots.

Owners are node agents (host and SSD tiers) and workers (their device pools).

One task runs the protocol of ``omniflow.kv.index_store``: find the index → take a lease → send a
snapshot of everything held → publish the stores' events in batches with seq 1, 2, … and
heartbeat at a third of the lease. A refused batch or heartbeat (gap, lapsed lease, an
index whose Redis lost its data: a new run id) leads to a new lease or a snapshot; a lost
connection to a new lease and a snapshot once the index answers again. While no index is
reachable, events are dropped: the snapshot that follows the reconnection covers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from itertools import groupby

import grpc

from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.backoff import Backoff
from omniflow.errors import Unavailable
from omniflow.kv.blocks import KVLayout
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind
from omniflow.kv.wire import layout_from_proto, namespace_fields, tier_to_proto
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.tasks import stop_task

log = logging.getLogger(__name__)

_SNAPSHOT_CHUNK = 8192
_TYPE = {
    EventKind.STORED: kvindex_pb2.BlockEvent.TYPE_STORED,
    EventKind.REMOVED: kvindex_pb2.BlockEvent.TYPE_REMOVED,
}


def events_to_proto(events: list[BlockEvent]) -> list[kvindex_pb2.BlockEvent]:
    """Runs of events with the same kind, namespace and tier become one message each."""
    out = []
    for (kind, ns, tier), run in groupby(events, key=lambda e: (e.kind, e.namespace, e.tier)):
        if kind == EventKind.CLEARED:
            out.append(kvindex_pb2.BlockEvent(type=kvindex_pb2.BlockEvent.TYPE_CLEARED))
            continue
        if kind == EventKind.CLEARED_TIER:
            out.append(
                kvindex_pb2.BlockEvent(
                    type=kvindex_pb2.BlockEvent.TYPE_CLEARED, tier=tier_to_proto(tier)
                )
            )
            continue
        out.append(
            kvindex_pb2.BlockEvent(
                type=_TYPE[kind],
                **namespace_fields(ns),
                tier=tier_to_proto(tier),
                block_hashes=[e.block_hash for e in run],
            )
        )
    return out


def snapshot_chunks(
    owner_id: str, epoch: int, seq: int, entries: list[BlockEntry]
) -> Iterator[kvindex_pb2.SnapshotChunk]:
    """The header chunk, then the entries grouped by namespace and tier."""
    yield kvindex_pb2.SnapshotChunk(owner_id=owner_id, epoch=epoch, seq=seq)
    entries = sorted(entries, key=lambda e: (e.namespace, e.tier))
    for (ns, tier), run in groupby(entries, key=lambda e: (e.namespace, e.tier)):
        hashes = [e.block_hash for e in run]
        for i in range(0, len(hashes), _SNAPSHOT_CHUNK):
            yield kvindex_pb2.SnapshotChunk(
                **namespace_fields(ns),
                tier=tier_to_proto(tier),
                block_hashes=hashes[i : i + _SNAPSHOT_CHUNK],
            )


class _Reacquire(Exception):
    """The lease is gone (unknown owner, stale epoch, index lost its data)."""


@dataclass(eq=False)
class IndexLink:
    """Keeps one owner's blocks announced in the KV index.

    ``find_index`` answers the index's address (asked again on every reconnection),
    ``drain`` the stores' events since its last call, ``entries`` all they hold (for a
    snapshot). ``lease_ms`` 0 leaves the lease's length to the index.
    """

    owner_id: str
    node: str
    address: str
    find_index: Callable[[], Awaitable[str]]
    drain: Callable[[], list[BlockEvent]]
    entries: Callable[[], list[BlockEntry]]
    _: KW_ONLY
    lease_ms: int = 0
    publish_interval_s: float = 0.02
    #: With nothing to publish the wait doubles up to this (an idle owner costs no CPU);
    #: ``wake()`` ends a wait at once, so the first event after a quiet spell is not late.
    idle_interval_s: float = 0.5
    call_timeout_s: float = 5.0
    max_batch: int = 8192
    kind: int = kvindex_pb2.OWNER_KIND_AGENT

    def __post_init__(self) -> None:
        # Where the protocol stands: the index found, the lease held, the last batch sent.
        self.index_address = ""
        self.epoch = 0
        self.seq = 0
        self.run_id = ""
        self.snapshots = 0
        self.connected = asyncio.Event()
        self._channel: TracedChannel | None = None
        self._stub: kvindex_pb2_grpc.KVIndexServiceStub | None = None
        self._pending: list[BlockEvent] = []
        self._snapshot_wanted = False
        self._task: asyncio.Task[None] | None = None
        self._layouts: dict[bytes, KVLayout] = {}
        self._wake = asyncio.Event()
        self._waking = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="kv-index-link")

    def wake(self) -> None:
        """There are events to publish: end the link's wait now. Safe from any thread (the
        engine's step thread, an agent's I/O thread)."""
        loop = self._loop
        if self._waking or loop is None or loop.is_closed():
            return  # one wake-up in flight is enough (no syscall per event)
        self._waking = True
        loop.call_soon_threadsafe(self._wake.set)

    async def stop(self) -> None:
        """Stop publishing and give the lease up (the index drops our entries at once)."""
        await stop_task(self._task)
        if self._stub is not None and self.epoch:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.ReleaseLease(
                    kvindex_pb2.ReleaseLeaseRequest(owner_id=self.owner_id, epoch=self.epoch),
                    timeout=1.0,
                )
        if self._channel is not None:
            await self._channel.close()

    # --- namespaces -------------------------------------------------------------------------

    async def layout(self, namespace: bytes) -> KVLayout:
        """A namespace's layout, from the index (cached: layouts never change)."""
        lay = self._layouts.get(namespace)
        if lay is not None:
            return lay
        stub = await self._index_stub()
        ask = kvindex_pb2.GetNamespaceRequest(**namespace_fields(namespace))
        reply = await stub.GetNamespace(ask)
        lay = self._layouts[namespace] = layout_from_proto(reply.layout)
        return lay

    async def _index_stub(self) -> kvindex_pb2_grpc.KVIndexServiceStub:
        if self._stub is None:
            await self._connect()
        assert self._stub is not None
        return self._stub

    async def _connect(self) -> None:
        address = await self.find_index()
        if address != self.index_address or self._channel is None:
            if self._channel is not None:
                await self._channel.close()
            self._channel = open_channel(address, default_timeout_s=self.call_timeout_s)
            self._stub = kvindex_pb2_grpc.KVIndexServiceStub(self._channel)
            self.index_address = address

    # --- the protocol -----------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                await self._connect()
                await self._acquire()
                await self._snapshot()
                self.connected.set()
                backoff.reset()
                await self._serve()
            except asyncio.CancelledError:
                raise
            except _Reacquire as exc:
                log.info("kv index: %s; taking a new lease", exc)
            except (grpc.aio.AioRpcError, Unavailable) as exc:
                text = f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc)
                delay = backoff.next() or 2.0
                log.warning("kv index unreachable (%s); retrying in %.1fs", text, delay)
                self.connected.clear()
                self._pending.clear()
                self.drain()  # the snapshot after reconnecting covers these
                await asyncio.sleep(delay)
            except Exception:
                log.exception("kv index link failed; retrying")
                self.connected.clear()
                await asyncio.sleep(1.0)

    async def _acquire(self) -> None:
        assert self._stub is not None
        reply = await self._stub.AcquireLease(
            kvindex_pb2.AcquireLeaseRequest(
                owner_id=self.owner_id,
                kind=self.kind,
                node=self.node,
                address=self.address,
                ttl_ms=self.lease_ms,
            )
        )
        self.epoch, self.seq, self.run_id = reply.epoch, 0, reply.index_run_id
        self.lease_ms = reply.ttl_ms
        log.info("kv index lease: epoch %d, %d ms, run %s", self.epoch, reply.ttl_ms, self.run_id)

    async def _snapshot(self) -> None:
        """Replace what the index holds for us with what the stores hold now."""
        assert self._stub is not None
        # Events queued up to here are in the entries read just after; later ones are sent
        # after the snapshot (applying a STORED or REMOVED twice is harmless).
        self._pending.clear()
        self.drain()
        entries = self.entries()
        reply = await self._stub.Snapshot(
            snapshot_chunks(self.owner_id, self.epoch, self.seq, entries)
        )
        self.seq = reply.next_seq - 1
        self.snapshots += 1
        self._snapshot_wanted = False
        log.info("kv index snapshot: %d blocks (epoch %d)", reply.blocks, self.epoch)

    async def _serve(self) -> None:
        assert self._stub is not None
        beat_every = max(self.lease_ms / 3000.0, 0.05)
        next_beat = time.monotonic() + beat_every
        wait = self.publish_interval_s
        while True:
            if self._snapshot_wanted:
                await self._snapshot()
            now = time.monotonic()
            if now >= next_beat:
                await self._heartbeat()
                next_beat = now + beat_every
            # Before the drain: an event queued after it wakes the wait below.
            self._waking = False
            self._wake.clear()
            if await self._publish():
                # Busy: publish every interval, the events batching up meanwhile.
                wait = self.publish_interval_s
                await asyncio.sleep(wait)
                continue
            # Idle: wait longer each time (up to the next heartbeat), until woken.
            wait = min(2 * wait, self.idle_interval_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(min(wait, next_beat - time.monotonic()), 0.0)):
                    await self._wake.wait()

    async def _heartbeat(self) -> None:
        assert self._stub is not None
        reply = await self._stub.Heartbeat(
            kvindex_pb2.HeartbeatRequest(owner_id=self.owner_id, epoch=self.epoch)
        )
        if not reply.ok:
            raise _Reacquire("lease lost")
        if reply.index_run_id != self.run_id:
            raise _Reacquire(f"index run changed ({self.run_id} → {reply.index_run_id})")
        if reply.snapshot_requested:
            self._snapshot_wanted = True

    async def _publish(self) -> bool:
        """Send what is pending; True when there was something to send."""
        assert self._stub is not None
        if not self._pending:
            self._pending = self.drain()
        busy = bool(self._pending)
        while self._pending:
            batch = self._pending[: self.max_batch]
            reply = await self._stub.PublishEvents(
                kvindex_pb2.PublishEventsRequest(
                    owner_id=self.owner_id,
                    epoch=self.epoch,
                    seq=self.seq + 1,
                    events=events_to_proto(batch),
                )
            )
            if reply.accepted:
                self.seq += 1
                del self._pending[: len(batch)]
                continue
            if reply.reason in ("UNKNOWN_OWNER", "STALE_EPOCH"):
                raise _Reacquire(f"batch refused: {reply.reason}")
            log.info("kv index asked for a snapshot (%s)", reply.reason)
            await self._snapshot()
            return busy
        return busy
