"""The kv-agent gRPC edge: host and SSD tiers, zero-copy local access, agent-to-agent pulls.

Local workers map the host arena (``GetArena``) and read pages in place between
``LocatePages`` and ``Unpin``, or write them in place between a ``CommitPages`` reservation
and its commit. Remote agents stream pages (``GetPages``) or, with NIXL, read the pinned
slots directly, each pull under a grant of its own (``grants``). Every change of what
the agent holds reaches the index through ``IndexLink``. The agent serves local workers
even while no index is reachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import grpc
import numpy as np

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.discovery import find_address
from omniflow.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from omniflow.kv.arena import HEADER_BYTES
from omniflow.kv.blocks import KVLayout
from omniflow.kv.events import BlockEntry, BlockEvent, Tier
from omniflow.kv.index_link import IndexLink
from omniflow.kv.wire import (
    check_hashes,
    namespace_fields,
    read_namespace,
    tier_from_proto,
    tier_to_proto,
)
from omniflow.rpc.context import failed_call
from omniflow.rpc.server import Runtime, ServiceApp
from omniflow.rpc.servicer import AppServicer
from omniflow.tasks import stop_task
from omniflow_services.kv_agent import grants, metrics
from omniflow_services.kv_agent.config import KVAgentSettings
from omniflow_services.kv_agent.nixl_channel import (
    NixlChannel,
    nixl_unavailable_reason,
    ucx_devices,
)
from omniflow_services.kv_agent.pools import PagePool, Pools, safe_name
from omniflow_services.kv_agent.tensors import TensorStore
from omniflow_services.kv_agent.tiers import PageHandle
from omniflow_services.kv_agent.transfer import Counters, PageReceiver, Puller

log = logging.getLogger(__name__)

_T = TypeVar("_T")
MAX_HASHES = 65536
_RESERVATION_TTL_S = 30.0


class _Part(Generic[_T]):
    """A part of the app that ``start`` makes (``_<name>``): UNAVAILABLE until then."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = f"_{name}"

    def __get__(self, app: object, owner: type | None = None) -> _T:
        part = getattr(app, self._attr)
        if part is None:
            raise Unavailable("kv agent is starting")
        return part


class KVAgentServicer(AppServicer["KVAgentApp"], kvagent_pb2_grpc.KVAgentServiceServicer):
    # --- local arena ------------------------------------------------------------------------

    async def GetArena(
        self, request: kvagent_pb2.GetArenaRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.GetArenaResponse:
        pool, _ = await self.app.pool_for(read_namespace(request))
        return kvagent_pb2.GetArenaResponse(
            shm_name=pool.shm_name,
            slot_bytes=pool.page_bytes,
            num_slots=pool.arena.num_slots,
            node=self.app.node,
            arena_bytes=pool.mapping_bytes,
            page_bytes=pool.page_bytes,
            slot_stride=pool.arena.stride,
            data_offset=HEADER_BYTES,
            base_address=pool.base_address,
        )

    async def LocatePages(
        self, request: kvagent_pb2.LocatePagesRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.LocatePagesResponse:
        pool, ns, hashes = await self.app.chain(request)
        handles = await self.app.acquire(pool, ns, hashes)
        if not handles:
            return kvagent_pb2.LocatePagesResponse(shm_name=pool.shm_name)
        s = self.app.settings
        ttl_ms = min(request.pin_ttl_ms or s.pin_ttl_ms, s.max_pin_ttl_ms)  # capped here
        pin_id = self.app.pools.pin(pool, handles, ttl_ms / 1000)
        granted = b""  # a pulling agent's NIXL grant: these slots, registered until Unpin
        if request.nixl_grant:
            granted = await grants.grant(self.app.grants, self.app.pools, pool, pin_id,
                                         [h.slot for h in handles])  # fmt: skip
        slots = [
            kvagent_pb2.SlotRef(
                block_hash=h.block_hash,
                slot=h.slot,
                checksum=h.checksum,
                found_in=tier_to_proto(Tier.SSD if h.promoted else Tier.HOST),
            )
            for h in handles
        ]
        return kvagent_pb2.LocatePagesResponse(
            slots=slots, pin_id=pin_id, shm_name=pool.shm_name, nixl_metadata=granted
        )

    async def Unpin(
        self, request: kvagent_pb2.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.UnpinResponse:
        await grants.release(self.app.grants, self.app.pools, request.pin_id)
        return kvagent_pb2.UnpinResponse()

    async def CommitPages(
        self, request: kvagent_pb2.CommitPagesRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.CommitPagesResponse:
        pool, ns = await self.app.pool_for(read_namespace(request))
        pools, store = self.app.pools, pool.store
        reply = kvagent_pb2.CommitPagesResponse(shm_name=pool.shm_name)
        for slot in request.abort_slots:
            if pools.take_reserved(pool, slot):
                store.abort_slot(slot)
        for ref in request.slots:
            check_hashes([ref.block_hash])
            if not pools.take_reserved(pool, ref.slot):
                raise NotFound(f"slot {ref.slot} holds no reservation (committed, or it lapsed)")
            try:
                store.commit_slot(ref.slot, ns, ref.block_hash, ref.checksum)
            except DataLoss:  # the slot is freed, the page dropped
                reply.checksum_failures += 1
                continue
            except FailedPrecondition:  # wrong page for the slot: the reservation stays
                pools.note_reserved(pool, [ref.slot], _RESERVATION_TTL_S)
                raise
            reply.committed += 1
        asked = request.reservation_ttl_ms or _RESERVATION_TTL_S * 1000
        ttl = min(asked, self.app.settings.max_reservation_ttl_ms) / 1000  # capped here
        if request.reserve:
            slots = []
            try:
                for _ in range(request.reserve):
                    slots.append(store.reserve_any())
            finally:
                pools.note_reserved(pool, slots, ttl)
            reply.reserved_slots.extend(slots)
        if request.reserve_hashes:
            hashes = check_hashes(request.reserve_hashes, MAX_HASHES)
            reserved = []
            try:
                for h in hashes:
                    res = store.reserve(ns, h)
                    if res is None:
                        reply.already_held.append(h)
                    else:
                        reserved.append(res.slot)
                        reply.reservations.append(kvagent_pb2.SlotRef(block_hash=h, slot=res.slot))
            finally:
                pools.note_reserved(pool, reserved, ttl)
        return reply

    # --- streaming pages --------------------------------------------------------------------

    async def PutPages(
        self,
        request_iterator: AsyncIterator[kvagent_pb2.PageChunk],
        context: grpc.aio.ServicerContext,
    ) -> kvagent_pb2.PutPagesResponse:
        receiver: PageReceiver | None = None
        try:
            async for chunk in request_iterator:
                if receiver is None:
                    pool, ns = await self.app.pool_for(read_namespace(chunk))
                    receiver = PageReceiver(
                        pool, ns, self.app.settings.max_chunk_bytes, self.app.counters
                    )
                elif (chunk.namespace_id or chunk.namespace) and read_namespace(
                    chunk
                ) != receiver.namespace:
                    raise InvalidArgument("one PutPages stream carries pages of one namespace")
                receiver.feed(chunk)
        finally:
            if receiver is not None:
                receiver.close()
        if receiver is None:
            return kvagent_pb2.PutPagesResponse()
        return kvagent_pb2.PutPagesResponse(
            stored=receiver.stored, rejected=receiver.rejected, errors=receiver.errors
        )

    async def GetPages(
        self, request: kvagent_pb2.GetPagesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvagent_pb2.PageChunk]:
        pool, ns, hashes = await self.app.chain(request)
        first = namespace_fields(ns)  # on each page's first chunk
        chunk = request.chunk_bytes or self.app.settings.chunk_bytes
        chunk = min(chunk, self.app.settings.max_chunk_bytes)
        pb = pool.page_bytes
        window = 64
        for start in range(0, len(hashes), window):
            part = hashes[start : start + window]
            handles = await self.app.acquire(pool, ns, part)
            try:
                for handle in handles:
                    view = pool.arena.view(handle.slot)
                    for off in range(0, pb, chunk):
                        end = min(off + chunk, pb)
                        yield kvagent_pb2.PageChunk(
                            **(first if off == 0 else {}),
                            block_hash=handle.block_hash,
                            offset=off,
                            data=view[off:end].tobytes(),
                            page_bytes=pb,
                            checksum=handle.checksum if off == 0 else 0,
                            last=end == pb,
                        )
                    self.app.counters.pages_sent += 1
                    metrics.transferred("grpc", "out", 1, pb)
            finally:
                for handle in handles:
                    pool.store.release(handle)
            if len(handles) < len(part):
                return

    async def PullPages(
        self, request: kvagent_pb2.PullPagesRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.PullPagesResponse:
        pool, ns, hashes = await self.app.chain(request)
        if not request.source_address:
            raise InvalidArgument("source_address (the agent holding the pages) is required")
        if request.source_address == self.app.address:
            raise InvalidArgument("source_address is this agent; use LocatePages")
        await self.app.check_source(request.source_address)
        res = await self.app.puller.pull(pool, ns, hashes, request.source_address, request.channel)
        return kvagent_pb2.PullPagesResponse(
            pulled=res.pulled, checksum_failures=res.checksum_failures, channel=res.channel,
            bytes=res.bytes,
        )  # fmt: skip

    async def FetchPages(
        self, request: kvagent_pb2.FetchPagesRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.FetchPagesResponse:
        pool, ns, hashes = await self.app.chain(request)
        handles = await self.app.acquire(pool, ns, hashes)
        for handle in handles:
            pool.store.release(handle)
        return kvagent_pb2.FetchPagesResponse(fetched=len(handles))

    async def Evict(
        self, request: kvagent_pb2.EvictRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.EvictResponse:
        tier = tier_from_proto(request.tier) if request.tier else None
        if tier == Tier.DEVICE:
            raise InvalidArgument("an agent has no device tier; use TIER_HOST or TIER_SSD")
        if request.block_hashes or request.namespace_id or request.namespace:
            pools = [(await self.app.pool_for(read_namespace(request)))]
        else:
            pools = [(p, b"") for p in self.app.pools.all()]
        hashes = check_hashes(request.block_hashes, MAX_HASHES)
        demoted, dropped = await asyncio.to_thread(
            self.app.pools.evict, pools, hashes, tier, request.target_free_bytes
        )
        return kvagent_pb2.EvictResponse(demoted=demoted, dropped=dropped)

    async def Stats(
        self, request: kvagent_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.StatsResponse:
        return self.app.stats()

    async def GetTransport(
        self, request: kvagent_pb2.GetTransportRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.GetTransportResponse:
        reply = kvagent_pb2.GetTransportResponse(channels=["grpc"])
        if self.app.nixl is not None:
            reply.channels.append("nixl")  # its metadata only in a grant (LocatePages)
            reply.nixl_agent_name = self.app.nixl.name
        return reply

    # --- tensors ----------------------------------------------------------------------------

    async def PutTensor(
        self,
        request_iterator: AsyncIterator[kvagent_pb2.TensorChunk],
        context: grpc.aio.ServicerContext,
    ) -> kvagent_pb2.PutTensorResponse:
        tensors = self.app.tensors
        header: kvagent_pb2.TensorChunk | None = None
        buf = np.empty(0, np.uint8)
        got = 0
        async for chunk in request_iterator:
            if header is None:
                header = chunk
                if chunk.size_bytes > tensors.budget_bytes:
                    raise InvalidArgument(
                        f"tensor of {chunk.size_bytes} bytes exceeds the budget of "
                        f"{tensors.budget_bytes} bytes"
                    )
                buf = np.empty(chunk.size_bytes, np.uint8)
            n = len(chunk.data)
            if n > self.app.settings.max_chunk_bytes:
                raise InvalidArgument(
                    f"chunk of {n} bytes exceeds the limit of {self.app.settings.max_chunk_bytes}"
                )
            if chunk.offset != got or got + n > buf.size:
                raise InvalidArgument(
                    f"tensor chunk at offset {chunk.offset} of {n} bytes does not follow the "
                    f"{got} bytes received (size {buf.size}); chunks must be in order"
                )
            buf[got : got + n] = np.frombuffer(chunk.data, np.uint8)
            got += n
        if header is None:
            raise InvalidArgument("PutTensor needs at least one chunk (the header)")
        if got != buf.size:
            raise InvalidArgument(f"tensor ended after {got} of {buf.size} bytes")
        ref = await asyncio.to_thread(
            tensors.put,
            buf,
            shape=list(header.shape),
            dtype=header.dtype,
            ttl_s=header.ttl_ms / 1000 if header.ttl_ms else None,
            checksum=header.checksum,
        )
        return kvagent_pb2.PutTensorResponse(
            ref=common_pb2.TensorRef(
                owner=self.app.owner_id,
                address=self.app.address,
                handle=ref.ref_id,
                shape=list(ref.shape),
                dtype=ref.dtype,
                checksum=ref.checksum,
                size_bytes=ref.nbytes,
                expires_at_unix_ms=int(ref.expires_at * 1000),
                node=self.app.node,
            )
        )

    async def GetTensor(
        self, request: kvagent_pb2.GetTensorRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvagent_pb2.TensorChunk]:
        ref = self.app.tensors.lookup(request.ref.handle)
        data = await asyncio.to_thread(self.app.tensors.read_bytes, ref.ref_id)
        chunk = min(request.chunk_bytes or self.app.settings.chunk_bytes, len(data) or 1)
        ttl_ms = max(0, int((ref.expires_at - time.time()) * 1000))
        for off in range(0, max(len(data), 1), chunk):
            first = off == 0
            yield kvagent_pb2.TensorChunk(
                shape=list(ref.shape) if first else [],
                dtype=ref.dtype if first else "",
                checksum=ref.checksum if first else 0,
                size_bytes=ref.nbytes if first else 0,
                ttl_ms=ttl_ms if first else 0,
                data=data[off : off + chunk],
                offset=off,
            )

    async def DeleteTensor(
        self, request: kvagent_pb2.DeleteTensorRequest, context: grpc.aio.ServicerContext
    ) -> kvagent_pb2.DeleteTensorResponse:
        return kvagent_pb2.DeleteTensorResponse(found=self.app.tensors.delete(request.ref.handle))


class KVAgentApp(ServiceApp):
    """One per node: the host and SSD tiers, and agent-to-agent transfer."""

    name = "kv-agent"

    def __init__(self, settings: KVAgentSettings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None
        self.counters = Counters()
        self.nixl: NixlChannel | None = None
        self.grants: grants.NixlGrants | None = None  # with NIXL: one per pull
        self._pools: Pools | None = None
        self._tensors: TensorStore | None = None
        self._link: IndexLink | None = None
        self._puller: Puller | None = None
        self._upkeep: asyncio.Task[None] | None = None
        self._namespaces: set[bytes] = set()  # served so far (bounded: max_namespaces)
        self._unwatch = metrics.watch(lambda: self._pools, lambda: self._tensors)

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        kvagent_pb2_grpc.add_KVAgentServiceServicer_to_server(KVAgentServicer(self), server)
        return [kvagent_pb2.DESCRIPTOR.services_by_name["KVAgentService"].full_name]

    # --- parts, available once started ------------------------------------------------------

    pools = _Part[Pools]()
    tensors = _Part[TensorStore]()
    puller = _Part[Puller]()
    link = _Part[IndexLink]()

    @property
    def owner_id(self) -> str:
        return self.runtime.instance_id if self.runtime else ""

    @property
    def address(self) -> str:
        return self.runtime.address if self.runtime else ""

    @property
    def node(self) -> str:
        return self.runtime.node if self.runtime else ""

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self, runtime: Runtime) -> None:
        s = self.settings
        self.runtime = runtime
        if "nixl" in s.channels:
            reason = nixl_unavailable_reason()
            if reason is None:
                name = f"{safe_name(runtime.instance_id)}-{uuid.uuid4().hex[:8]}"
                devices = ucx_devices(s.nixl_devices, s.host)
                self.nixl = await asyncio.to_thread(NixlChannel, name, devices)
                self.grants = grants.NixlGrants(self.nixl)
            else:
                log.info("NIXL channel off: %s", reason)
        self._pools = Pools(self.shm_prefix(runtime.instance_id), s, on_events=self._queued)
        recovered = await asyncio.to_thread(self._pools.recover_ssd)
        for pool in recovered:
            log.info(
                "recovered %d SSD pages of %d bytes", len(pool.store.entries()), pool.page_bytes
            )
        self._tensors = TensorStore(
            self.shm_prefix(runtime.instance_id) + "-tensors",
            s.tensor_bytes,
            default_ttl_s=s.tensor_ttl_s,
        )
        self._puller = Puller(self.counters, self.nixl, s)
        self._link = IndexLink(
            runtime.instance_id,
            runtime.node,
            runtime.address,
            self._find_index,
            self._pools.drain_events,
            self._entries,
            lease_ms=s.lease_ms,
            publish_interval_s=s.publish_interval_ms / 1000,
            call_timeout_s=s.call_timeout_s,
        )
        self._link.start()
        self._upkeep = asyncio.create_task(self._upkeep_loop())

    def _queued(self, events: list[BlockEvent]) -> None:
        if self._link is not None:
            self._link.wake()

    def shm_prefix(self, instance_id: str) -> str:
        """The start of this agent's shared-memory names: its instance id and, when set,
        the tag of its topology (two local topologies both have a "kv-agent")."""
        tag = self.settings.shm_tag
        return safe_name(f"{instance_id}-{tag}" if tag else instance_id)

    def _entries(self) -> list[BlockEntry]:
        out: list[BlockEntry] = []
        for pool in self.pools.all():
            out += pool.store.entries()
        return out

    async def check_source(self, address: str) -> None:
        """Pull only from an agent in discovery, never from an address a caller made up."""
        assert self.runtime is not None
        agents = await self.runtime.registry.list("kv-agent")
        if not any(a.address == address for a in agents):
            raise PermissionDenied(
                f"source_address {address!r} is not a kv-agent in discovery; pages are pulled "
                "only from registered agents"
            )

    async def _find_index(self) -> str:
        registry = self.runtime.registry if self.runtime is not None else None
        return await find_address(registry, "kv-index", configured=self.settings.index_addr)

    async def _upkeep_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await grants.expire(self.grants, self.pools)
                await asyncio.to_thread(self.tensors.sweep)
            except Exception:
                log.exception("kv agent upkeep failed")

    async def stop(self) -> None:
        self._unwatch()
        await stop_task(self._upkeep)
        if self._link is not None:
            await self._link.stop()
        if self._puller is not None:
            await self._puller.close()
        if self.nixl is not None:
            await asyncio.to_thread(self.nixl.close)
        if self._tensors is not None:
            self._tensors.close()
        if self._pools is not None:
            self._pools.close()

    def metadata(self) -> dict[str, str]:
        channels = ["grpc"] + (["nixl"] if self.nixl is not None else [])
        return {"channels": ",".join(channels), "owner_id": self.owner_id}

    # --- helpers for the servicer -----------------------------------------------------------

    async def layout(self, namespace: bytes) -> KVLayout:
        try:
            with failed_call("kv index"):
                return await self.link.layout(namespace)
        except NotFound:
            raise NotFound(f"namespace {namespace.hex()} is not registered at the index") from None

    async def pool_for(self, ns: bytes) -> tuple[PagePool, bytes]:
        """The pool of a namespace (its page size comes from the index)."""
        if ns not in self._namespaces and len(self._namespaces) >= self.settings.max_namespaces:
            raise ResourceExhausted(
                f"this agent serves {len(self._namespaces)} KV namespaces, the limit: raise "
                "OMNIFLOW_KV_MAX_NAMESPACES"
            )
        layout = await self.layout(ns)
        pool = self.pools.pool(layout.page_bytes)
        self._namespaces.add(ns)  # counted once it has a pool: unknown ones cost nothing
        return pool, ns

    async def chain(self, request: Any) -> tuple[PagePool, bytes, list[bytes]]:
        """A page request's pool, namespace and block hashes (checked, MAX_HASHES at most)."""
        pool, ns = await self.pool_for(read_namespace(request))
        return pool, ns, check_hashes(request.block_hashes, MAX_HASHES)

    async def acquire(self, pool: PagePool, ns: bytes, hashes: list[bytes]) -> list[PageHandle]:
        """Pin the leading run of ``hashes`` held here (SSD pages promoted to host): in a
        thread when there is an SSD tier (its I/O may block), inline when host-only."""
        if pool.store.ssd is None:
            return pool.store.acquire_chain(ns, hashes)
        return await asyncio.to_thread(pool.store.acquire_chain, ns, hashes)

    def stats(self) -> kvagent_pb2.StatsResponse:
        host = kvagent_pb2.TierUsage(tier=tier_to_proto(Tier.HOST))
        ssd = kvagent_pb2.TierUsage(tier=tier_to_proto(Tier.SSD))
        failures = 0
        for pool in self.pools.all():
            st = pool.store.stats()
            host.pages += st.host_pages
            host.capacity_pages += st.host_budget
            host.bytes += st.host_pages * pool.page_bytes
            host.hits += st.host_hits
            host.misses += st.misses
            ssd.pages += st.ssd_pages
            ssd.capacity_pages += st.ssd_budget
            ssd.bytes += st.ssd_pages * pool.page_bytes
            ssd.hits += st.ssd_hits
            failures += st.checksum_failures
        return kvagent_pb2.StatsResponse(
            agent_id=self.owner_id,
            node=self.node,
            tiers=[host, ssd],
            checksum_failures=failures,
            pages_sent=self.counters.pages_sent,
            pages_received=self.counters.pages_received,
            tensors=len(self.tensors),
            tensor_bytes=self.tensors.used_bytes,
        )
