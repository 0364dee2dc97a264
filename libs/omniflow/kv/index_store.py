"""The KV index's store (DESIGN §4.2): which owner holds which block, in which tier, on Redis.

The core of the kv-index service (``omniflow_services.kv_index`` is its gRPC edge: it
converts messages to the dataclasses below and maps the domain errors). It lives in the
library because the key layout and its Lua scripts are a shared format: the router's direct
``MatchPrefix`` path and the echo test worker read and write the same keys. Every
multi-key operation is one Lua script (EVALSHA), so each call is one round trip and atomic.

Key layout (``P`` = the prefix, default ``of:kv:``; ``hash`` is a raw 16-byte block hash,
which already mixes in its namespace, so the namespace is checked here, not stored per block):

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
with no hash tag is wrapped in one (``{of:kv:}``), so that every key above is in one slot and
each script touches only that slot (the run marker is each script's declared key, which a
cluster client routes by). The index then runs on a cluster as on one Redis; it does not
spread over the cluster's masters (docs/deploy.md).

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
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_exc

from omniflow.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from omniflow.kv.blocks import KVLayout, check_hash, check_namespace
from omniflow.kv.events import CLEAR_KINDS, BlockEntry, BlockEvent, EventKind, Tier

log = logging.getLogger(__name__)

_LUA = Path(__file__).with_name("lua")
_OWNER_ID = re.compile(r"^[A-Za-z0-9._:/@+-]{1,200}$")
_SNAPSHOT_CHUNK = 8192


class OwnerKind(StrEnum):
    WORKER = "worker"
    AGENT = "agent"


class LeaseStatus(IntEnum):
    OK = 0
    UNKNOWN_OWNER = 1
    STALE_EPOCH = 2
    SEQUENCE_GAP = 3


@dataclass(frozen=True, slots=True)
class OwnerInfo:
    """Who holds blocks: a worker's device pool or a node agent (host + SSD tiers)."""

    owner_id: str
    node: str
    address: str
    kind: OwnerKind = OwnerKind.AGENT


@dataclass(frozen=True, slots=True)
class Lease:
    """The owner's current epoch; its next event batch carries ``seq = 1``."""

    owner_id: str
    epoch: int
    lease_ms: int
    run_id: str


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """The owner's set was replaced; its next batch carries ``next_seq``."""

    owner_id: str
    epoch: int
    next_seq: int
    blocks: int


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    status: LeaseStatus
    run_id: str
    last_seq: int

    @property
    def reregister_required(self) -> bool:
        return self.status != LeaseStatus.OK


@dataclass(frozen=True, slots=True)
class EventsResult:
    """Outcome of a batch; on a gap ``last_seq`` is the last batch the index applied."""

    status: LeaseStatus
    last_seq: int
    applied: int

    @property
    def ok(self) -> bool:
        return self.status == LeaseStatus.OK

    @property
    def expected_seq(self) -> int:
        """The seq the next batch must carry."""
        return self.last_seq + 1

    @property
    def snapshot_required(self) -> bool:
        return self.status != LeaseStatus.OK

    @property
    def reregister_required(self) -> bool:
        return self.status in (LeaseStatus.UNKNOWN_OWNER, LeaseStatus.STALE_EPOCH)


@dataclass(frozen=True, slots=True)
class OwnerMatch:
    """How many leading blocks of the chain one owner holds; ``tier`` is the slowest of them."""

    owner_id: str
    node: str
    address: str
    kind: str
    matched_blocks: int
    blocks_per_tier: tuple[int, int, int]  # device, host, ssd

    @property
    def tier(self) -> Tier:
        return max((t for t in Tier if self.blocks_per_tier[t]), default=Tier.DEVICE)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Owners sorted by matched blocks (desc), then fastest tier, then id."""

    longest_prefix: int
    owners: tuple[OwnerMatch, ...]


@dataclass(frozen=True, slots=True)
class IndexStats:
    """``blocks`` counts (owner, block) entries of live owners: a block two owners hold
    counts twice. ``pending_garbage``: block sets of past epochs not yet swept."""

    live_owners: int
    registered_owners: int
    blocks: int
    blocks_per_tier: dict[str, int]
    namespaces: int
    pending_garbage: int


@dataclass(frozen=True, slots=True)
class SweepResult:
    owners_dropped: int
    entries_removed: int
    pending_garbage: int
    run_restored: bool = False


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
        if _is_cluster(redis) and not _HASH_TAG.search(prefix):
            # Every script reads and writes keys of many owners and blocks: on a Redis
            # Cluster they must all be in one slot, so the prefix becomes their hash tag.
            prefix = "{" + prefix + "}"
        self._p = prefix.encode()
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

    # --- namespaces -------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def register_namespace(self, layout: KVLayout) -> bytes:
        """Register a KV layout (idempotent); returns its 16-byte namespace."""
        ns = layout.namespace
        await self._r.hset(self._p + b"ns", ns.hex(), json.dumps(asdict(layout)))
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
        epoch, run, created = await self._run(
            "register",
            [
                self._p,
                owner.owner_id,
                owner.node,
                owner.address,
                str(owner.kind),
                lease_ms,
                uuid.uuid4().hex,
            ],
        )
        self._run_id = run.decode()
        if created:
            log.warning("run marker was missing at registration of %s", owner.owner_id)
            await self._restore_namespaces()
        return Lease(owner.owner_id, int(epoch), lease_ms, self._run_id)

    @_unavailable_on_redis_error
    async def heartbeat(self, owner_id: str, epoch: int) -> HeartbeatResult:
        _check_owner_id(owner_id)
        status, run, seq = await self._run("heartbeat", [self._p, owner_id, epoch])
        return HeartbeatResult(LeaseStatus(status), run.decode(), int(seq))

    @_unavailable_on_redis_error
    async def deregister_owner(self, owner_id: str) -> None:
        """Drop an owner now (graceful shutdown); its entries are swept in the background."""
        _check_owner_id(owner_id)
        await self._run("sweep", [self._p, 0, owner_id])

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
        status, last, applied = await self._run(
            "apply", [self._p, owner_id, epoch, "E", seq, pack_events(events)]
        )
        result = EventsResult(LeaseStatus(status), int(last), int(applied))
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
        status, _ = await self._run("snapshot_begin", [self._p, owner_id, epoch, seq])
        if status != LeaseStatus.OK:
            raise FailedPrecondition(
                f"owner {owner_id} epoch {epoch} is not current ({LeaseStatus(status).name}); "
                "register again, then send the snapshot"
            )
        for i in range(0, len(events), _SNAPSHOT_CHUNK):
            chunk = pack_events(events[i : i + _SNAPSHOT_CHUNK])
            status, _, _ = await self._run("apply", [self._p, owner_id, epoch, "S", 0, chunk])
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
        rows = await self._run("match", [self._p, b"".join(hashes)])
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
        live, reg, t0, t1, t2, nns, gc = await self._run("stats", [self._p])
        return IndexStats(
            live_owners=int(live),
            registered_owners=int(reg),
            blocks=int(t0) + int(t1) + int(t2),
            blocks_per_tier={"device": int(t0), "host": int(t1), "ssd": int(t2)},
            namespaces=int(nns),
            pending_garbage=int(gc),
        )

    # --- maintenance ------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def sweep(self, max_steps: int = 64) -> SweepResult:
        """Drop owners whose lease lapsed and remove stale entries, in bounded chunks."""
        restored = await self.check_run()
        dropped = removed = pending = 0
        for _ in range(max_steps):
            d, r, pending = await self._run("sweep", [self._p, self.sweep_chunk, ""])
            dropped += int(d)
            removed += int(r)
            if not pending:
                break
        return SweepResult(dropped, removed, int(pending), restored)

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

    async def _run(self, script: str, args: list[Any]) -> Any:
        # The run marker is declared as the script's key: it names the slot (a cluster client
        # routes by it) where every key the script builds from the prefix lives.
        return await getattr(self._s, script)(keys=[self._p + b"run"], args=args)

    async def _check_namespaces(self, namespaces: Iterable[bytes]) -> None:
        for ns in set(namespaces):
            await self.layout(ns)


_HASH_TAG = re.compile(r"\{[^}]+\}")


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
