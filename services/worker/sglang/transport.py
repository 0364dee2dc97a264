"""Page I/O with the node's kv-agent for the SGLang HiCache backend (blocking gRPC).

SGLang calls its storage backend from its own threads (prefetch, backup), synchronously,
inside the scheduler process: so this client is the blocking gRPC API, with no event loop.
It speaks the kv-agent protocol directly (``kvagent.v1``):

- ``put``: zero-copy when the agent's arena is mapped on this node (``CommitPages``
  reserve → write the slots in place → commit with checksums), else ``PutPages`` streamed
  in chunks;
- ``get``: ``LocatePages`` pins the leading run and the pages are read from the arena and
  verified against their checksums, else ``GetPages`` streamed; before that, when the index
  says another node's agent holds a longer prefix, the local agent pulls it
  (``PullPages``: agent to agent);
- ``exists``: the longer of what the local agent holds (``LocatePages``, unpinned at once)
  and what the index (``MatchPrefix``) reports for any agent.

Every page carries its xxh3_64 checksum; a page that does not match is a miss. Errors
surface as ``omniflow.errors`` (never gRPC ones).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import DataLoss, FailedPrecondition, InvalidArgument, OmniflowError
from omniflow.kv.arena import HostArena
from omniflow.kv.blocks import HASH_BYTES, KVLayout
from omniflow.kv.checksum import page_checksum
from omniflow.kv.wire import layout_to_proto
from omniflow.rpc.client import sync_channel
from omniflow.rpc.status import error_from_rpc
from omniflow_services.worker.sglang.pages import batched

log = logging.getLogger(__name__)

PageData = bytes | bytearray | memoryview | np.ndarray
_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class NoArena(FailedPrecondition):
    """The agent's shared-memory arena cannot be mapped here (another node or container)."""


@dataclass(slots=True)
class TransportStats:
    """Counters since start (read by ``get_stats`` and the GPU report)."""

    pages_put: int = 0
    pages_got: int = 0
    pages_pulled: int = 0
    checksum_failures: int = 0
    zero_copy_puts: int = 0
    streamed_puts: int = 0
    zero_copy_gets: int = 0
    streamed_gets: int = 0
    errors: int = 0


def page_chunks(
    namespace_hex: str, hashes: Sequence[bytes], pages: Sequence[PageData], chunk_bytes: int
) -> Iterator[kvagent_pb2.PageChunk]:
    """The ``PutPages`` stream of ``pages``: each page cut in chunks of ``chunk_bytes``, its
    checksum and the namespace on its first chunk."""
    if chunk_bytes <= 0:
        raise InvalidArgument(f"chunk_bytes must be > 0, got {chunk_bytes}")
    for h, page in zip(hashes, pages, strict=True):
        buf = _as_bytes(page)
        size = len(buf)
        for off in range(0, max(size, 1), chunk_bytes):
            end = min(off + chunk_bytes, size)
            yield kvagent_pb2.PageChunk(
                namespace=namespace_hex if off == 0 else "",
                block_hash=h,
                offset=off,
                data=bytes(buf[off:end]),
                page_bytes=size,
                checksum=page_checksum(buf) if off == 0 else 0,
                last=end == size,
            )


class PageAssembler:
    """Rebuilds pages from a ``GetPages`` stream; keeps the leading run of whole, verified
    pages in the order asked for."""

    def __init__(self, hashes: Sequence[bytes], page_bytes: int) -> None:
        self.hashes = list(hashes)
        self.page_bytes = page_bytes
        self.pages: list[bytearray] = []
        self.checksum_failures = 0
        self._buf: bytearray | None = None
        self._want = 0
        self._done = False

    def feed(self, chunk: kvagent_pb2.PageChunk) -> None:
        if self._done:
            return
        i = len(self.pages)
        if i >= len(self.hashes) or chunk.block_hash != self.hashes[i]:
            self._done = True  # out of order or unasked: stop at the run we have
            return
        if self._buf is None:
            if chunk.offset != 0 or chunk.page_bytes != self.page_bytes:
                self._done = True
                return
            self._buf, self._want = bytearray(), chunk.checksum
        if chunk.offset != len(self._buf):
            self._done = True
            return
        self._buf += chunk.data
        if chunk.last:
            buf, self._buf = self._buf, None
            if len(buf) != self.page_bytes or page_checksum(buf) != self._want:
                self.checksum_failures += 1
                self._done = True
                return
            self.pages.append(buf)


class AgentPageStore:
    """Pages of one namespace at the node's kv-agent (and the index, when given)."""

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
        self.ns_hex = layout.namespace_hex
        self.index_address = index_address
        self.timeout_s = timeout_s
        self.zero_copy = zero_copy
        self.chunk_bytes = chunk_bytes
        self.max_batch = max_batch
        self.stats = TransportStats()
        self.agent_id = ""
        self._agent_channel = sync_channel(agent_address, options=_GRPC_OPTIONS)
        self._agent = kvagent_pb2_grpc.KVAgentServiceStub(self._agent_channel)
        self._index_channel: grpc.Channel | None = None
        self._index: kvindex_pb2_grpc.KVIndexServiceStub | None = None
        if index_address:
            self._index_channel = sync_channel(index_address, options=_GRPC_OPTIONS)
            self._index = kvindex_pb2_grpc.KVIndexServiceStub(self._index_channel)
        self._arenas: dict[str, HostArena] = {}
        self._lock = threading.Lock()  # the arena map; gRPC stubs are thread-safe

    def close(self) -> None:
        with self._lock:
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()
        self._agent_channel.close()
        if self._index_channel is not None:
            self._index_channel.close()

    # --- plumbing ---------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], request: object) -> Any:
        try:
            return fn(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self.stats.errors += 1
            err = error_from_rpc(exc)  # type: ignore[arg-type]
            raise type(err)(f"{what}: {err}") from None

    def _arena(self, shm_name: str) -> HostArena:
        with self._lock:
            arena = self._arenas.get(shm_name)
            if arena is None:
                try:
                    arena = self._arenas[shm_name] = HostArena.attach(shm_name)
                except (OmniflowError, OSError) as exc:
                    raise NoArena(f"cannot map the agent's arena {shm_name!r}: {exc}") from None
            return arena

    def _check(self, hashes: Sequence[bytes]) -> list[bytes]:
        out = list(hashes)
        for i, h in enumerate(out):
            if len(h) != HASH_BYTES:
                raise InvalidArgument(f"hash {i} has {len(h)} bytes; block hashes are 16")
        return out

    def register(self) -> None:
        """Make the namespace known to the index (the agent learns page sizes from it)."""
        if self._index is None:
            # Without an index the agent can only serve a namespace someone registered.
            self._call(
                "kv agent", self._agent.GetArena, kvagent_pb2.GetArenaRequest(namespace=self.ns_hex)
            )
            return
        reply = self._call(
            "kv index",
            self._index.RegisterNamespace,
            kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(self.layout)),
        )
        if reply.page_bytes and reply.page_bytes != self.layout.page_bytes:
            raise FailedPrecondition(
                f"the index has {reply.page_bytes}-byte pages for namespace "
                f"{self.ns_hex}; this layout's are {self.layout.page_bytes}"
            )

    def _agent_id(self) -> str:
        if not self.agent_id:
            reply = self._call("kv agent", self._agent.Stats, kvagent_pb2.StatsRequest())
            self.agent_id = reply.agent_id
        return self.agent_id

    # --- exists -----------------------------------------------------------------------------

    def local_count(self, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` the local agent holds (host or SSD)."""
        hashes = self._check(hashes)
        total = 0
        for part in batched(hashes, self.max_batch):
            reply = self._call(
                "kv agent",
                self._agent.LocatePages,
                kvagent_pb2.LocatePagesRequest(namespace=self.ns_hex, block_hashes=part),
            )
            if reply.pin_id:
                self._unpin(reply.pin_id)
            total += len(reply.slots)
            if len(reply.slots) < len(part):
                break
        return total

    def remote_source(self, hashes: Sequence[bytes]) -> tuple[int, kvindex_pb2.OwnerMatch | None]:
        """(leading blocks the local agent holds per the index, the agent of another node
        that holds strictly more, if any). ``(0, None)`` without an index."""
        if self._index is None or not hashes:
            return 0, None
        reply = self._call(
            "kv index",
            self._index.MatchPrefix,
            kvindex_pb2.MatchPrefixRequest(namespace=self.ns_hex, block_hashes=list(hashes)),
        )
        me = self._agent_id()
        local, best = 0, None
        for o in reply.owners:
            if o.owner_id == me:
                local = max(local, o.matched_blocks)
            elif o.kind == kvindex_pb2.OWNER_KIND_AGENT and (
                best is None or o.matched_blocks > best.matched_blocks
            ):
                best = o
        if best is not None and best.matched_blocks <= local:
            best = None
        return local, best

    def exists(self, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` that ``get`` can bring (local, or pulled)."""
        hashes = self._check(hashes)
        local = self.local_count(hashes)
        if local == len(hashes):
            return local
        try:
            _, remote = self.remote_source(hashes)
        except OmniflowError as exc:  # the index is an accelerator
            log.info("kv index unavailable for exists (%s); local pages only", exc)
            return local
        return max(local, remote.matched_blocks if remote is not None else 0)

    # --- get --------------------------------------------------------------------------------

    def get(self, hashes: Sequence[bytes]) -> list[np.ndarray]:
        """The verified bytes of the longest leading run of ``hashes`` (copies, uint8)."""
        hashes = self._check(hashes)
        if not hashes:
            return []
        try:
            _, remote = self.remote_source(hashes)
            if remote is not None:
                self._pull(hashes[: remote.matched_blocks], remote)
        except OmniflowError as exc:
            log.info("no pull from another agent (%s); reading local pages", exc)
        out: list[np.ndarray] = []
        for part in batched(hashes, self.max_batch):
            got = self._get_local(list(part))
            out.extend(got)
            if len(got) < len(part):
                break
        self.stats.pages_got += len(out)
        return out

    def _pull(self, hashes: list[bytes], source: kvindex_pb2.OwnerMatch) -> None:
        reply = self._call(
            f"pull from {source.address}",
            self._agent.PullPages,
            kvagent_pb2.PullPagesRequest(
                namespace=self.ns_hex,
                block_hashes=hashes,
                source_address=source.address,
                source_owner=source.owner_id,
            ),
        )
        self.stats.pages_pulled += reply.pulled
        self.stats.checksum_failures += reply.checksum_failures

    def _get_local(self, hashes: list[bytes]) -> list[np.ndarray]:
        if self.zero_copy:
            try:
                return self._get_in_place(hashes)
            except NoArena as exc:  # not on the agent's node: stream from now on
                log.info("%s; streaming pages", exc)
                self.zero_copy = False
        return self._get_streamed(hashes)

    def _get_in_place(self, hashes: list[bytes]) -> list[np.ndarray]:
        reply = self._call(
            "kv agent",
            self._agent.LocatePages,
            kvagent_pb2.LocatePagesRequest(namespace=self.ns_hex, block_hashes=hashes),
        )
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
            self._unpin(reply.pin_id)
        self.stats.zero_copy_gets += len(out)
        return out

    def _get_streamed(self, hashes: list[bytes]) -> list[np.ndarray]:
        asm = PageAssembler(hashes, self.layout.page_bytes)
        try:
            stream = self._agent.GetPages(
                kvagent_pb2.GetPagesRequest(
                    namespace=self.ns_hex, block_hashes=hashes, chunk_bytes=self.chunk_bytes
                ),
                timeout=self.timeout_s,
            )
            for chunk in stream:
                asm.feed(chunk)
        except grpc.RpcError as exc:
            self.stats.errors += 1
            err = error_from_rpc(exc)
            raise type(err)(f"kv agent GetPages: {err}") from None
        self.stats.checksum_failures += asm.checksum_failures
        self.stats.streamed_gets += len(asm.pages)
        return [np.frombuffer(p, dtype=np.uint8) for p in asm.pages]

    def _unpin(self, pin_id: str) -> None:
        try:
            self._call("kv agent unpin", self._agent.Unpin, kvagent_pb2.UnpinRequest(pin_id=pin_id))
        except OmniflowError as exc:  # the pin lapses on its own
            log.info("%s", exc)

    # --- put --------------------------------------------------------------------------------

    def put(self, hashes: Sequence[bytes], pages: Sequence[PageData]) -> int:
        """Store pages (contract byte order) at the local agent; returns how many the agent
        now holds of them (stored now or before). Raises on a transport fault."""
        hashes = self._check(hashes)
        if len(hashes) != len(pages):
            raise InvalidArgument(f"{len(hashes)} hashes but {len(pages)} pages")
        want = self.layout.page_bytes
        for i, p in enumerate(pages):
            if len(_as_bytes(p)) != want:
                raise InvalidArgument(f"page {i} is {len(_as_bytes(p))} bytes; pages are {want}")
        held = 0
        for start in range(0, len(hashes), self.max_batch):
            hs = hashes[start : start + self.max_batch]
            ps = pages[start : start + self.max_batch]
            held += self._put_batch(hs, ps)
        self.stats.pages_put += held
        return held

    def _put_batch(self, hashes: list[bytes], pages: Sequence[PageData]) -> int:
        if self.zero_copy:
            try:
                return self._put_in_place(hashes, pages)
            except NoArena as exc:  # not on the agent's node: stream from now on
                log.info("%s; streaming pages", exc)
                self.zero_copy = False
        return self._put_streamed(hashes, pages)

    def _put_in_place(self, hashes: list[bytes], pages: Sequence[PageData]) -> int:
        reply = self._call(
            "kv agent reserve",
            self._agent.CommitPages,
            kvagent_pb2.CommitPagesRequest(namespace=self.ns_hex, reserve_hashes=hashes),
        )
        already = len(reply.already_held)
        if not reply.reservations:
            return already
        by_hash = dict(zip(hashes, pages, strict=True))
        refs = []
        try:
            arena = self._arena(reply.shm_name)
            for res in reply.reservations:
                src = np.frombuffer(_as_bytes(by_hash[res.block_hash]), dtype=np.uint8)
                np.copyto(arena.view(res.slot), src)
                refs.append(
                    kvagent_pb2.SlotRef(
                        block_hash=res.block_hash, slot=res.slot, checksum=page_checksum(src)
                    )
                )
        except BaseException:
            slots = [r.slot for r in reply.reservations]
            try:
                self._call(
                    "kv agent abort",
                    self._agent.CommitPages,
                    kvagent_pb2.CommitPagesRequest(namespace=self.ns_hex, abort_slots=slots),
                )
            except OmniflowError as exc:  # reservations lapse on their own
                log.info("%s", exc)
            raise
        done = self._call(
            "kv agent commit",
            self._agent.CommitPages,
            kvagent_pb2.CommitPagesRequest(namespace=self.ns_hex, slots=refs),
        )
        if done.checksum_failures:
            self.stats.checksum_failures += done.checksum_failures
            raise DataLoss(f"{done.checksum_failures} pages changed before their commit")
        self.stats.zero_copy_puts += done.committed
        return already + done.committed

    def _put_streamed(self, hashes: list[bytes], pages: Sequence[PageData]) -> int:
        stream = page_chunks(self.ns_hex, hashes, pages, self.chunk_bytes)
        reply = self._call("kv agent PutPages", self._agent.PutPages, stream)
        if reply.rejected:
            self.stats.checksum_failures += reply.rejected
            raise DataLoss(
                f"the agent rejected {reply.rejected} pages: {'; '.join(reply.errors)[:300]}"
            )
        self.stats.streamed_puts += reply.stored
        # PutPages counts what it stored; pages it held already are not errors.
        return len(hashes)


def _as_bytes(page: PageData) -> memoryview:
    if isinstance(page, np.ndarray):
        return memoryview(np.ascontiguousarray(page).reshape(-1).view(np.uint8))
    return memoryview(page).cast("B")
