"""The KV index's store (DESIGN §4.2): which owner holds which block, in which tier, on Redis.

The core of the kv-index service (``omniflow_services.kv_index`` is its gRPC edge: it
converts messages to the records of ``omniflow.kv.index_types`` and maps the domain
errors). It lives in the library because the key layout and its Lua scripts are a shared
format: the router's direct ``MatchPrefix`` path and the echo test worker read and write
the same keys. Every multi-key operation on a shard is one Lua script (EVALSHA): atomic in
its shard, and a match is one round trip.

Key layout. The control keys are under ``P`` (the prefix, default ``of:kv:``): ``P run``,
``P ns``, ``P e:<owner>`` (the one epoch counter), ``P i:<owner>`` (node, address, kind,
lease_ms) and ``P l:<owner>`` (a copy of the lease). Each namespace is a shard of its own,
prefix ``S`` = ``P n:<namespace hex>:``, holding the keys below (``S run`` is the shard's
marker, ``S ns`` unused); ``hash`` is a raw 16-byte block hash, which already mixes in its
namespace, so the namespace is checked here, not stored per block. Every shard knows every
owner: registration, heartbeat, batches and snapshots run on all shards (a batch gives each
its own events and the clears, so each keeps the owner's sequence); a match runs on one.

=============================  =========================================================
``P run``                      string: run id, written once per Redis data set. Missing
                               means Redis lost its data: namespaces are rewritten from
                               the core's cache and owners learn it as "unknown owner".
``P ns``                       hash: namespace hex → KVLayout as JSON
``P e:<owner>``                counter: the owner's epoch (INCR at each registration)
``P g:<owner>``                counter: the owner's generation (INCR at each registration
                               and each snapshot); entries are tagged with it
``P o:<owner>``                hash: epoch, gen, seq (last applied batch), node, address,
                               kind, lease_ms, n0/n1/n2 (blocks held per tier in this gen)
``P l:<owner>``                string: the live generation, with a TTL of lease_ms (the lease)
``P owners``                   set of registered owner ids
``P b:<hash>``                 hash: owner id → ``gen * 4 + tier``. An entry counts only
                               while its gen equals the owner's lease value, so a dead,
                               restarted or re-snapshotted owner's old entries are ignored
                               at once, before cleanup.
``P s:<owner>:<gen>``          hash: ``<hash>`` → tier, what the owner holds in that gen
``P gc``                       list of ``<owner>\\n<gen>``: block sets of past generations and
                               dead owners, removed chunk by chunk by ``sweep``
=============================  =========================================================

On a Redis Cluster (``redis+cluster://`` URLs, ``omniflow.localredis.redis_client``) a prefix
with no hash tag gets one per shard: ``{of:kv:}`` for the control keys, ``{of:kv:n:<ns>}:``
for a namespace's, so that each script touches one slot (the shard's run marker is each
script's declared key, which a cluster client routes by) while the namespaces spread over
the masters (docs/data-flow.md). A prefix that has a hash tag keeps every key in its slot.

Protocol for an owner: ``register_owner`` → (epoch, seq 0) → ``snapshot`` of what it
holds → ``apply_events`` with seq 1, 2, … and ``heartbeat`` within the lease. A gap in seq
asks for a snapshot (same epoch; the snapshot names the seq it is consistent with); an
unknown owner or stale epoch (lease lapsed, Redis restarted, or another process registered
the id) asks for a re-registration and a snapshot.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_exc

from omniflow.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from omniflow.kv.blocks import KVLayout, check_hash, check_namespace
from omniflow.kv.events import CLEAR_KINDS, BlockEntry, BlockEvent, EventKind
from omniflow.kv.index_types import (
    EventsResult,
    HeartbeatResult,
    IndexStats,
    Lease,
    LeaseStatus,
    MatchResult,
    OwnerInfo,
    OwnerKind,
    OwnerMatch,
    SnapshotResult,
    SweepResult,
)

log = logging.getLogger(__name__)

_LUA = Path(__file__).with_name("lua")
_OWNER_ID = re.compile(r"^[A-Za-z0-9._:/@+-]{1,200}$")
_SNAPSHOT_CHUNK = 8192


@dataclass(slots=True)
class _Scripts:
    register: aioredis.client.AsyncScript | None = None
    heartbeat: aioredis.client.AsyncScript | None = None
    apply: aioredis.client.AsyncScript | None = None
    snapshot_begin: aioredis.client.AsyncScript | None = None
    match: aioredis.client.AsyncScript | None = None
    stats: aioredis.client.AsyncScript | None = None
    sweep: aioredis.client.AsyncScript | None = None
    loaded: list[str] = field(default_factory=list)


def pack_events(events: Iterable[BlockEvent]) -> bytes:
    """34 bytes per event: kind, tier, namespace, hash (zeros for the clear kinds)."""
    out = bytearray()
    for ev in events:
        out += bytes((int(ev.kind), int(ev.tier)))
        out += bytes(32) if ev.kind in CLEAR_KINDS else ev.namespace + ev.block_hash
    return bytes(out)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _unavailable_on_redis_error(
    fn: Callable[_P, Awaitable[_R]],
) -> Callable[_P, Awaitable[_R]]:
    """Turn a lost Redis connection into ``Unavailable`` (the caller retries later)."""

    @functools.wraps(fn)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await fn(*args, **kwargs)
        except (redis_exc.ConnectionError, redis_exc.TimeoutError) as exc:
            raise Unavailable(f"kv index: Redis is unreachable ({exc}); retry") from exc

    return wrapper


class KVIndex:
    """Redis-backed block ownership index. Use one instance per process; it is async-safe."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        prefix: str = "of:kv:",
        default_lease_ms: int = 5000,
        max_hashes: int = 8192,
        max_events: int = 16384,
        sweep_chunk: int = 1024,
    ) -> None:
        if redis.get_encoder().decode_responses:
            raise ValueError("KVIndex needs a Redis client with decode_responses=False")
        self._r = redis
        # The namespace shards: on a Redis Cluster each gets its own hash tag (its slot),
        # unless the prefix already carries one (then everything shares that slot).
        self._tagged = _is_cluster(redis) and not _HASH_TAG.search(prefix)
        self._raw = prefix.encode()
        self._p = b"{" + self._raw + b"}" if self._tagged else self._raw
        self.default_lease_ms = default_lease_ms
        self.max_hashes = max_hashes
        self.max_events = max_events
        self.sweep_chunk = sweep_chunk
        self._layouts: dict[bytes, KVLayout] = {}
        self._run_id = ""
        self._s = _Scripts()
        for name in ("register", "heartbeat", "apply", "snapshot_begin", "match", "stats", "sweep"):
            # register_script falls back to EVAL on NOSCRIPT (e.g. after a Redis restart).
            setattr(self._s, name, redis.register_script((_LUA / f"{name}.lua").read_text()))

    @property
    def run_id(self) -> str:
        """Id of the Redis data set this index last saw; it changes when Redis lost its data."""
        return self._run_id

    @_unavailable_on_redis_error
    async def start(self) -> None:
        """Ping Redis, write the run marker if absent, load the registered namespaces."""
        await self._r.ping()
        await self.check_run()
        for ns_hex, raw in (await self._r.hgetall(self._p + b"ns")).items():
            self._layouts[bytes.fromhex(ns_hex.decode())] = KVLayout(**json.loads(raw))

    @_unavailable_on_redis_error
    async def check_run(self) -> bool:
        """Make sure the run marker exists; True if it had to be recreated (data was lost)."""
        new = uuid.uuid4().hex
        created = await self._r.set(self._p + b"run", new, nx=True)
        if created:
            if self._run_id:
                log.warning("Redis lost the KV index (run marker missing); owners must re-announce")
            self._run_id = new
            await self._restore_namespaces()
            return True
        self._run_id = (await self._r.get(self._p + b"run") or b"").decode()
        return False

    async def _restore_namespaces(self) -> None:
        if self._layouts:
            mapping = {ns.hex(): json.dumps(asdict(lay)) for ns, lay in self._layouts.items()}
            await self._r.hset(self._p + b"ns", mapping=mapping)
            for ns in self._layouts:
                await self._r.set(self._shard(ns) + b"run", self._run_id or "-", nx=True)

    # --- namespaces -------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def register_namespace(self, layout: KVLayout) -> bytes:
        """Register a KV layout (idempotent); returns its 16-byte namespace."""
        ns = layout.namespace
        await self._r.hset(self._p + b"ns", ns.hex(), json.dumps(asdict(layout)))
        # The shard's run marker says it exists and kept its data: owners registered before
        # the namespace are then taken into it at their next call (``_adopt``).
        await self._r.set(self._shard(ns) + b"run", self._run_id or "-", nx=True)
        self._layouts[ns] = layout
        return ns

    @_unavailable_on_redis_error
    async def layout(self, namespace: bytes) -> KVLayout:
        """The layout of a registered namespace; NotFound otherwise."""
        check_namespace(namespace)
        lay = self._layouts.get(namespace)
        if lay is None:
            raw = await self._r.hget(self._p + b"ns", namespace.hex())
            if raw is None:
                raise NotFound(f"namespace {namespace.hex()} is not registered")
            lay = self._layouts[namespace] = KVLayout(**json.loads(raw))
        return lay

    # --- owners -----------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def register_owner(self, owner: OwnerInfo, lease_ms: int | None = None) -> Lease:
        """Start a new epoch for ``owner``; everything it held before is ignored from now on."""
        _check_owner_id(owner.owner_id)
        lease_ms = lease_ms or self.default_lease_ms
        if not 100 <= lease_ms <= 3_600_000:
            raise InvalidArgument(f"lease_ms must be in [100, 3600000], got {lease_ms}")
        if await self.check_run():
            log.warning("run marker was missing at registration of %s", owner.owner_id)
        # One epoch for every shard: the control slot's counter.
        epoch = int(await self._r.incr(self._p + b"e:" + owner.owner_id.encode()))
        args = [owner.owner_id, owner.node, owner.address, str(owner.kind), lease_ms]
        # What a shard needs to take the owner in later (a namespace registered after it).
        await self._r.hset(
            self._p + b"i:" + owner.owner_id.encode(),
            mapping=dict(
                zip(("node", "address", "kind", "lease_ms"), map(str, args[1:]), strict=True)
            ),
        )
        await self._on_shards("register", await self._shards(), [*args, uuid.uuid4().hex, epoch])
        await self._control_refresh(owner.owner_id, lease_ms)
        return Lease(owner.owner_id, epoch, lease_ms, self._run_id)

    @_unavailable_on_redis_error
    async def heartbeat(self, owner_id: str, epoch: int) -> HeartbeatResult:
        _check_owner_id(owner_id)
        shards = await self._shards()
        run = (await self._r.get(self._p + b"run") or b"").decode()
        if not shards:
            status, seq = await self._control_lease(owner_id, epoch), 0
            return HeartbeatResult(status, run, seq)
        rows = await self._on_shards("heartbeat", shards, [owner_id, epoch])
        known = [int(r[2]) for r in rows if int(r[0]) != LeaseStatus.UNKNOWN_OWNER]
        answers = []
        for shard, row in zip(shards, rows, strict=True):
            if int(row[0]) == LeaseStatus.UNKNOWN_OWNER and await self._adoptable(
                shard, owner_id, epoch
            ):
                if not known:
                    continue  # taken in at its first batch, which names the sequence
                await self._adopt(shard, owner_id, epoch, min(known))
                row = await self._run_on(shard, "heartbeat", [owner_id, epoch])
            answers.append((int(row[0]), int(row[2])))
        status, seq = _worst(answers) if answers else (LeaseStatus.OK, 0)
        if status == LeaseStatus.OK:
            await self._control_refresh(owner_id)
        return HeartbeatResult(LeaseStatus(status), run, seq)

    @_unavailable_on_redis_error
    async def deregister_owner(self, owner_id: str) -> None:
        """Drop an owner now (graceful shutdown); its entries are swept in the background."""
        _check_owner_id(owner_id)
        await self._r.delete(self._p + b"l:" + owner_id.encode())
        await self._on_shards("sweep", await self._shards(), [0, owner_id])

    # --- events -----------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def apply_events(
        self, owner_id: str, epoch: int, seq: int, events: Sequence[BlockEvent]
    ) -> EventsResult:
        """Apply one batch; ``seq`` must be the previous batch's plus one.

        STORED upserts the owner's entry with the event's tier (the fastest tier the owner
        holds the block in); REMOVED drops the owner's entry whatever its tier.
        """
        _check_owner_id(owner_id)
        if len(events) > self.max_events:
            raise InvalidArgument(
                f"a batch holds at most {self.max_events} events, got {len(events)}"
            )
        if seq < 1:
            raise InvalidArgument(f"seq must be >= 1, got {seq}")
        await self._check_namespaces(ev.namespace for ev in events if ev.kind not in CLEAR_KINDS)
        shards = await self._shards()
        if not shards:
            status = await self._control_lease(owner_id, epoch)
            return EventsResult(status, seq if status == LeaseStatus.OK else 0, 0)
        # Every shard sees every batch (its namespace's events and the clears; none for the
        # others), so each keeps the owner's sequence and lease.
        per_shard: dict[bytes, list[BlockEvent]] = {sh: [] for sh in shards}
        for ev in events:
            if ev.kind in CLEAR_KINDS:
                for evs in per_shard.values():
                    evs.append(ev)
            else:
                per_shard.setdefault(self._shard(ev.namespace), []).append(ev)
        batches = [(sh, pack_events(evs)) for sh, evs in per_shard.items()]
        args = [owner_id, epoch, "E", seq]
        rows = list(
            await asyncio.gather(*(self._run_on(sh, "apply", [*args, b]) for sh, b in batches))
        )
        for i, (shard, packed) in enumerate(batches):
            if int(rows[i][0]) == LeaseStatus.UNKNOWN_OWNER:
                if await self._adopt(shard, owner_id, epoch, seq - 1):
                    rows[i] = await self._run_on(shard, "apply", [*args, packed])
        status, last = _worst([(int(r[0]), int(r[1])) for r in rows])
        applied = len(events) if status == LeaseStatus.OK else 0
        if status == LeaseStatus.OK:
            await self._control_refresh(owner_id)
        result = EventsResult(LeaseStatus(status), last, applied)
        if not result.ok:
            log.info("events of %s epoch %s seq %s refused: %s", owner_id, epoch, seq, result)
        return result

    @_unavailable_on_redis_error
    async def snapshot(
        self, owner_id: str, epoch: int, entries: Sequence[BlockEntry], seq: int = 0
    ) -> SnapshotResult:
        """Replace everything the owner holds; ``seq`` is the last batch it is consistent with.

        The epoch stays; the next batch carries ``seq + 1``. Raises FailedPrecondition when
        the epoch is stale or the owner unknown: register again, then snapshot.
        """
        _check_owner_id(owner_id)
        if seq < 0:
            raise InvalidArgument(f"seq must be >= 0, got {seq}")
        events = [BlockEvent(EventKind.STORED, e.namespace, e.block_hash, e.tier) for e in entries]
        await self._check_namespaces(e.namespace for e in entries)
        shards = await self._shards()
        rows = await self._on_shards("snapshot_begin", shards, [owner_id, epoch, seq])
        for i, shard in enumerate(shards):
            if int(rows[i][0]) == LeaseStatus.UNKNOWN_OWNER:
                if await self._adopt(shard, owner_id, epoch, seq):
                    rows[i] = [LeaseStatus.OK, seq]
        status = (
            _worst([(int(r[0]), 0) for r in rows])[0]
            if shards
            else await self._control_lease(owner_id, epoch)
        )
        if status != LeaseStatus.OK:
            raise FailedPrecondition(
                f"owner {owner_id} epoch {epoch} is not current ({LeaseStatus(status).name}); "
                "register again, then send the snapshot"
            )
        by_shard: dict[bytes, list[BlockEvent]] = {}
        for ev in events:
            by_shard.setdefault(self._shard(ev.namespace), []).append(ev)
        for shard, evs in by_shard.items():
            for i in range(0, len(evs), _SNAPSHOT_CHUNK):
                chunk = pack_events(evs[i : i + _SNAPSHOT_CHUNK])
                status, _, _ = await self._run_on(shard, "apply", [owner_id, epoch, "S", 0, chunk])
                if status != LeaseStatus.OK:
                    raise FailedPrecondition(
                        f"owner {owner_id} lost its lease during the snapshot; register again"
                    )
        return SnapshotResult(owner_id, epoch, seq + 1, len(events))

    # --- queries ----------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def match_prefix(self, namespace: bytes, hashes: Sequence[bytes]) -> MatchResult:
        """Per live owner, the number of leading blocks of ``hashes`` it holds. One round trip."""
        if len(hashes) > self.max_hashes:
            raise InvalidArgument(f"at most {self.max_hashes} hashes per match, got {len(hashes)}")
        for i, h in enumerate(hashes):
            check_hash(h, f"hash {i}")
        await self.layout(namespace)
        if not hashes:
            return MatchResult(0, ())
        rows = await self._run_on(self._shard(namespace), "match", [b"".join(hashes)])
        owners = [
            OwnerMatch(
                owner_id=r[0].decode(),
                matched_blocks=int(r[1]),
                blocks_per_tier=(int(r[2]), int(r[3]), int(r[4])),
                node=r[5].decode(),
                address=r[6].decode(),
                kind=r[7].decode(),
            )
            for r in rows
        ]
        owners.sort(key=lambda o: (-o.matched_blocks, o.tier, o.owner_id))
        return MatchResult(owners[0].matched_blocks if owners else 0, tuple(owners))

    @_unavailable_on_redis_error
    async def stats(self) -> IndexStats:
        shards = await self._shards()
        rows = [[int(x) for x in r] for r in await self._on_shards("stats", shards, [])]
        # Every owner is registered in every shard: its count is the largest shard's.
        t0, t1, t2 = (sum(r[i] for r in rows) for i in (2, 3, 4))
        return IndexStats(
            live_owners=max((r[0] for r in rows), default=0),
            registered_owners=max((r[1] for r in rows), default=0),
            blocks=t0 + t1 + t2,
            blocks_per_tier={"device": t0, "host": t1, "ssd": t2},
            namespaces=len(shards),
            pending_garbage=sum(r[6] for r in rows),
        )

    # --- maintenance ------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def sweep(self, max_steps: int = 64) -> SweepResult:
        """Drop owners whose lease lapsed and remove stale entries, in bounded chunks."""
        restored = await self.check_run()
        dropped = removed = pending = 0
        for shard in await self._shards():
            for _ in range(max_steps):
                d, r, left = await self._run_on(shard, "sweep", [self.sweep_chunk, ""])
                removed += int(r)
                if d:  # an owner whose lease lapsed lapsed in every shard: count it once
                    dropped = max(dropped, int(d))
                if not left:
                    break
            pending += int(left)
        return SweepResult(dropped, removed, pending, restored)

    async def maintenance_loop(self, interval_s: float, stop: asyncio.Event) -> None:
        """Sweep every ``interval_s`` until ``stop`` is set; errors are logged, not raised."""
        while not stop.is_set():
            try:
                res = await self.sweep()
                if res.owners_dropped or res.entries_removed:
                    log.info("kv index sweep: %s", res)
            except Exception:  # keep sweeping through a Redis outage
                log.exception("kv index sweep failed")
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass

    def _shard(self, namespace: bytes) -> bytes:
        """The key prefix of a namespace's shard: its blocks, owner sets and leases."""
        if self._tagged:
            return b"{" + self._raw + b"n:" + namespace.hex().encode() + b"}:"
        return self._p + b"n:" + namespace.hex().encode() + b":"

    async def _shards(self) -> list[bytes]:
        # Read every time: another process may have registered a namespace since.
        names = await self._r.hkeys(self._p + b"ns")
        return sorted(self._shard(bytes.fromhex(n.decode())) for n in names)

    async def _adopt(self, shard: bytes, owner_id: str, epoch: int, seq: int) -> bool:
        """Take a current owner into a shard that does not know it: a namespace registered
        after the owner, which it holds nothing of yet. Not a shard that lost its data (its
        run marker is gone): there the owner must register again and send its snapshot."""
        if not await self._adoptable(shard, owner_id, epoch):
            return False
        info = await self._r.hmget(
            self._p + b"i:" + owner_id.encode(), "node", "address", "kind", "lease_ms"
        )
        if info[3] is None:
            return False
        node, address, kind, lease_ms = (v.decode() for v in info)
        args = [owner_id, node, address, kind, lease_ms, uuid.uuid4().hex, epoch]
        await self._run_on(shard, "register", args)
        status, _ = await self._run_on(shard, "snapshot_begin", [owner_id, epoch, seq])
        return int(status) == LeaseStatus.OK

    async def _adoptable(self, shard: bytes, owner_id: str, epoch: int) -> bool:
        if not await self._r.exists(shard + b"run"):
            return False
        return await self._control_lease(owner_id, epoch) == LeaseStatus.OK

    async def _control_lease(self, owner_id: str, epoch: int) -> LeaseStatus:
        """The lease status when no namespace exists yet: the control slot's epoch only."""
        # Both keys are in the control slot.
        cur, live = await self._r.mget(
            self._p + b"e:" + owner_id.encode(), self._p + b"l:" + owner_id.encode()
        )
        if cur is None:
            return LeaseStatus.UNKNOWN_OWNER
        if int(cur) != int(epoch) or live is None:
            return LeaseStatus.STALE_EPOCH
        return LeaseStatus.OK

    async def _control_refresh(self, owner_id: str, lease_ms: int | None = None) -> None:
        """The control slot's copy of the lease (what ``_adopt`` trusts) lives as long."""
        key = self._p + b"l:" + owner_id.encode()
        if lease_ms is not None:
            await self._r.set(key, 1, px=lease_ms)
            return
        raw = await self._r.hget(self._p + b"i:" + owner_id.encode(), "lease_ms")
        if raw is not None:
            await self._r.pexpire(key, int(raw))

    async def _run_on(self, shard: bytes, script: str, args: list[Any]) -> Any:
        # The shard's run marker is declared as the script's key: it names the slot (a
        # cluster client routes by it) where every key the script builds from it lives.
        return await getattr(self._s, script)(keys=[shard + b"run"], args=[shard, *args])

    async def _on_shards(self, script: str, shards: list[bytes], args: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*(self._run_on(sh, script, args) for sh in shards)))

    async def _check_namespaces(self, namespaces: Iterable[bytes]) -> None:
        for ns in set(namespaces):
            await self.layout(ns)


_HASH_TAG = re.compile(r"\{[^}]+\}")
# Which status wins when shards disagree: a re-registration over a snapshot over success.
_SEVERITY = {
    LeaseStatus.OK: 0,
    LeaseStatus.SEQUENCE_GAP: 1,
    LeaseStatus.STALE_EPOCH: 2,
    LeaseStatus.UNKNOWN_OWNER: 3,
}


def _worst(rows: list[tuple[int, int]]) -> tuple[LeaseStatus, int]:
    """(status, seq) of the shard answers: the most severe status; its shard's seq (the
    lowest seq among equals, so that a lagging shard asks for what it lacks)."""
    status, seq = min(rows, key=lambda r: (-_SEVERITY[LeaseStatus(r[0])], r[1]))
    return LeaseStatus(status), seq


def _is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def _check_owner_id(owner_id: str) -> None:
    if not _OWNER_ID.match(owner_id):
        raise InvalidArgument(
            f"owner id {owner_id!r} must be 1-200 characters of letters, digits and ._:/@+-"
        )


def validate_layout(layout: KVLayout, page_bytes: int) -> None:
    """Raise InvalidArgument when a page of ``page_bytes`` does not fit ``layout``."""
    if page_bytes != layout.page_bytes:
        raise InvalidArgument(
            f"page is {page_bytes} bytes but namespace {layout.namespace_hex} "
            f"({layout.model_id}) has pages of {layout.page_bytes} bytes"
        )


__all__ = [
    "EventsResult",
    "HeartbeatResult",
    "IndexStats",
    "KVIndex",
    "Lease",
    "LeaseStatus",
    "MatchResult",
    "OwnerInfo",
    "OwnerKind",
    "OwnerMatch",
    "SnapshotResult",
    "SweepResult",
    "pack_events",
    "validate_layout",
]
