"""The kv-index gRPC edge: KVIndexService over the Redis-backed store
(``omniflow.kv.index_store.KVIndex``, in the library: the router's direct path shares it).

Health turns SERVING once Redis answered and the core loaded its namespaces. A
maintenance task sweeps lapsed owners and stale entries, and notices a Redis that lost its
data (the run marker is gone): the run id changes and every owner's next heartbeat or
batch is refused, which makes it take a new lease and send a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import redis.asyncio as aioredis

from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from omniflow.kv.blocks import HASH_BYTES
from omniflow.kv.events import BlockEntry, BlockEvent, EventKind
from omniflow.kv.index_store import KVIndex, LeaseStatus, OwnerInfo, OwnerKind
from omniflow.kv.wire import (
    check_hashes,
    layout_from_proto,
    layout_to_proto,
    namespace_fields,
    read_namespace,
    tier_from_proto,
    tier_to_proto,
)
from omniflow.localredis import redact_url, redis_client
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.servicer import AppServicer
from omniflow.security.policy import require_owner
from omniflow_services.kv_index import metrics
from omniflow_services.kv_index.config import KVIndexSettings

log = logging.getLogger(__name__)

_KIND_FROM_PROTO = {
    kvindex_pb2.OWNER_KIND_WORKER: OwnerKind.WORKER,
    kvindex_pb2.OWNER_KIND_AGENT: OwnerKind.AGENT,
}
_KIND_TO_PROTO = {str(v): k for k, v in _KIND_FROM_PROTO.items()}
_EVENT_KIND = {
    kvindex_pb2.BlockEvent.TYPE_STORED: EventKind.STORED,
    kvindex_pb2.BlockEvent.TYPE_REMOVED: EventKind.REMOVED,
}


def _bounded_hashes(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidArgument(
            f"{what} carries {count} block hashes; the limit is {limit} "
            "(raise it with OMNIFLOW_KV_MAX_HASHES)"
        )


def events_from_proto(msgs: list[kvindex_pb2.BlockEvent]) -> list[BlockEvent]:
    """Core events of a batch; a CLEARED with a tier clears that tier only."""
    out: list[BlockEvent] = []
    for i, msg in enumerate(msgs):
        if msg.type == kvindex_pb2.BlockEvent.TYPE_CLEARED:
            if msg.tier:
                out.append(BlockEvent(EventKind.CLEARED_TIER, tier=tier_from_proto(msg.tier)))
            else:
                out.append(BlockEvent(EventKind.CLEARED))
            continue
        kind = _EVENT_KIND.get(msg.type)
        if kind is None:
            raise InvalidArgument(
                f"event {i}: type must be TYPE_STORED, TYPE_REMOVED or TYPE_CLEARED, got {msg.type}"
            )
        ns = read_namespace(msg)
        tier = tier_from_proto(msg.tier, f"event {i} tier")
        for h in check_hashes(msg.block_hashes):
            out.append(BlockEvent(kind, ns, h, tier))
    return out


class KVIndexServicer(AppServicer["KVIndexApp"], kvindex_pb2_grpc.KVIndexServiceServicer):
    @property
    def core(self) -> KVIndex:
        if self.app.core is None:
            raise Unavailable("kv index is starting")
        return self.app.core

    async def RegisterNamespace(
        self, request: kvindex_pb2.RegisterNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.RegisterNamespaceResponse:
        if not request.HasField("layout"):
            raise InvalidArgument("layout is required")
        layout = layout_from_proto(request.layout)
        most = self.app.settings.max_page_bytes
        if layout.page_bytes > most:  # also keeps page_bytes within the reply's uint64
            raise InvalidArgument(
                f"layout: a page of this layout is {layout.page_bytes} bytes, more than the "
                f"largest accepted, {most} (raise it with OMNIFLOW_KV_MAX_PAGE_BYTES)"
            )
        limit = self.app.settings.max_index_namespaces
        if (await self.core.stats()).namespaces >= limit:
            try:
                await self.core.layout(layout.namespace)  # registering it again is fine
            except NotFound:
                raise ResourceExhausted(
                    f"{limit} KV namespaces are registered, the limit "
                    "(raise it with OMNIFLOW_KV_MAX_INDEX_NAMESPACES)"
                ) from None
        ns = await self.core.register_namespace(layout)
        return kvindex_pb2.RegisterNamespaceResponse(
            **namespace_fields(ns), page_bytes=layout.page_bytes
        )

    async def GetNamespace(
        self, request: kvindex_pb2.GetNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.GetNamespaceResponse:
        layout = await self.core.layout(read_namespace(request))
        return kvindex_pb2.GetNamespaceResponse(
            layout=layout_to_proto(layout), page_bytes=layout.page_bytes
        )

    async def AcquireLease(
        self, request: kvindex_pb2.AcquireLeaseRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.AcquireLeaseResponse:
        kind = _KIND_FROM_PROTO.get(request.kind)
        if kind is None:
            raise InvalidArgument("kind must be OWNER_KIND_WORKER or OWNER_KIND_AGENT")
        require_owner(request.owner_id, request.node)
        owner = OwnerInfo(request.owner_id, request.node, request.address, kind)
        limit = self.app.settings.max_owners
        if (await self.core.stats()).live_owners >= limit:
            # Lapsed owners leave within a sweep; until then new ones wait.
            raise ResourceExhausted(
                f"{limit} owners hold a lease, the limit (raise it with OMNIFLOW_KV_MAX_OWNERS)"
            )
        lease = await self.core.register_owner(owner, request.ttl_ms or None)
        log.info(
            "lease for %s (%s at %s): epoch %d", owner.owner_id, kind, owner.address, lease.epoch
        )
        return kvindex_pb2.AcquireLeaseResponse(
            epoch=lease.epoch, ttl_ms=lease.lease_ms, index_run_id=lease.run_id
        )

    async def Heartbeat(
        self, request: kvindex_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.HeartbeatResponse:
        require_owner(request.owner_id)
        res = await self.core.heartbeat(request.owner_id, request.epoch)
        return kvindex_pb2.HeartbeatResponse(
            ok=res.status == LeaseStatus.OK,
            snapshot_requested=res.status != LeaseStatus.OK,
            index_run_id=res.run_id,
        )

    async def ReleaseLease(
        self, request: kvindex_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.ReleaseLeaseResponse:
        # Only the holder of the current epoch may give the lease up.
        require_owner(request.owner_id)
        res = await self.core.heartbeat(request.owner_id, request.epoch)
        if res.status == LeaseStatus.OK:
            await self.core.deregister_owner(request.owner_id)
        return kvindex_pb2.ReleaseLeaseResponse()

    async def PublishEvents(
        self, request: kvindex_pb2.PublishEventsRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.PublishEventsResponse:
        _bounded_hashes(
            sum(len(e.block_hashes) for e in request.events),
            self.app.settings.max_hashes,
            "PublishEvents",
        )
        require_owner(request.owner_id)
        events = events_from_proto(list(request.events))
        res = await self.core.apply_events(request.owner_id, request.epoch, request.seq, events)
        metrics.BATCHES.labels("accepted" if res.ok else res.status.name.lower()).inc()
        if res.ok:
            metrics.ingested(events)
        return kvindex_pb2.PublishEventsResponse(
            accepted=res.ok,
            expected_seq=res.expected_seq,
            snapshot_required=res.snapshot_required,
            reason="" if res.ok else res.status.name,
        )

    async def Snapshot(
        self,
        request_iterator: AsyncIterator[kvindex_pb2.SnapshotChunk],
        context: grpc.aio.ServicerContext,
    ) -> kvindex_pb2.SnapshotResponse:
        header: kvindex_pb2.SnapshotChunk | None = None
        entries: list[BlockEntry] = []
        async for chunk in request_iterator:
            if header is None:
                header = chunk
                require_owner(header.owner_id)
            if not chunk.block_hashes:
                continue
            ns = read_namespace(chunk)
            tier = tier_from_proto(chunk.tier, "snapshot chunk tier")
            entries.extend(BlockEntry(ns, h, tier) for h in check_hashes(chunk.block_hashes))
            limit = self.app.settings.max_snapshot_blocks
            if len(entries) > limit:
                raise InvalidArgument(
                    f"the snapshot holds more than {limit} blocks, the limit "
                    "(raise it with OMNIFLOW_KV_MAX_SNAPSHOT_BLOCKS)"
                )
        if header is None:
            raise InvalidArgument("a snapshot needs at least one chunk (the header)")
        res = await self.core.snapshot(header.owner_id, header.epoch, entries, header.seq)
        metrics.SNAPSHOTS.inc()
        metrics.SNAPSHOT_BLOCKS.inc(len(entries))
        return kvindex_pb2.SnapshotResponse(blocks=res.blocks, next_seq=res.next_seq)

    async def MatchPrefix(
        self, request: kvindex_pb2.MatchPrefixRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.MatchPrefixResponse:
        ns = read_namespace(request)
        _bounded_hashes(len(request.block_hashes), self.core.max_hashes, "MatchPrefix")
        hashes = check_hashes(request.block_hashes)
        with metrics.MATCH_SECONDS.time():
            res = await self.core.match_prefix(ns, hashes)
        metrics.MATCH_BLOCKS.labels("asked").inc(len(hashes))
        metrics.MATCH_BLOCKS.labels("held").inc(res.longest_prefix)
        return kvindex_pb2.MatchPrefixResponse(
            longest_prefix=res.longest_prefix,
            owners=[
                kvindex_pb2.OwnerMatch(
                    owner_id=o.owner_id,
                    kind=_KIND_TO_PROTO.get(o.kind, kvindex_pb2.OWNER_KIND_UNSPECIFIED),
                    node=o.node,
                    address=o.address,
                    tier=tier_to_proto(o.tier),
                    matched_blocks=o.matched_blocks,
                )
                for o in res.owners
            ],
        )

    async def Stats(
        self, request: kvindex_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvindex_pb2.StatsResponse:
        st = await self.core.stats()
        tiers = [
            kvindex_pb2.TierStats(tier=t, blocks=st.blocks_per_tier[name])
            for t, name in ((1, "device"), (2, "host"), (3, "ssd"))
        ]
        return kvindex_pb2.StatsResponse(
            blocks=st.blocks,
            owners=st.live_owners,
            namespaces=st.namespaces,
            tiers=tiers,
            index_run_id=self.core.run_id,
        )


class KVIndexApp(ServiceApp):
    """The cluster-wide KV block index on Redis."""

    name = "kv-index"

    def __init__(self, settings: KVIndexSettings) -> None:
        self.settings = settings
        self.redis: aioredis.Redis | None = None
        self.core: KVIndex | None = None
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._gauges: asyncio.Task[None] | None = None

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        kvindex_pb2_grpc.add_KVIndexServiceServicer_to_server(KVIndexServicer(self), server)
        return [kvindex_pb2.DESCRIPTOR.services_by_name["KVIndexService"].full_name]

    async def start(self, runtime: Runtime) -> None:
        s = self.settings
        self.redis = redis_client(s.redis_url, s.call_timeout_s, decode_responses=False)
        core = KVIndex(
            self.redis,
            prefix=s.key_prefix,
            default_lease_ms=s.lease_ttl_ms,
            max_hashes=s.max_hashes,
        )
        try:
            await core.start()
        except Unavailable as exc:
            raise Unavailable(f"Redis at {redact_url(s.redis_url)} does not answer: {exc}") from exc
        self.core = core
        self._sweeper = asyncio.create_task(core.maintenance_loop(s.sweep_interval_s, self._stop))
        gauges = metrics.refresh_loop(core, max(s.sweep_interval_s, 1.0), self._stop)
        self._gauges = asyncio.create_task(gauges)
        log.info("kv index on %s, run %s", redact_url(s.redis_url), core.run_id)

    def metadata(self) -> dict[str, str]:
        return {"hash_bytes": str(HASH_BYTES)}

    async def stop(self) -> None:
        self._stop.set()
        for task in (self._sweeper, self._gauges):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.redis is not None:
            await self.redis.aclose()
