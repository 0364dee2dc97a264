"""The KV index's records (DESIGN §4.2): owners, leases, and what its calls answer.

Plain frozen dataclasses shared by the index's store (``omniflow.kv.index_store``, which
re-exports them), its gRPC edge, the router and the owners' link; no Redis here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum

from omniflow.kv.events import Tier


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
