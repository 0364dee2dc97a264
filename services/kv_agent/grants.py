"""NIXL grants: the source side of a NIXL pull, one grant per transfer. No gRPC here.

A pulling agent asks over mutual TLS (``LocatePages`` with ``nixl_grant``; the policy table
answers it for kv-agent certificates only). The source pins the pages, registers exactly
their slots with NIXL and hands back the NIXL metadata of those registrations alone, bound
to the pin and to the requester's certificate identity. ``Unpin`` by that identity, or the
pin's deadline, revokes the grant: the regions are deregistered *before* the pages are
released, so a slot is never registered while it holds another page. No arena is
registered otherwise, so an agent that reaches the UCX port without a grant has nothing
NIXL will READ (``initialize_xfer`` fails: no registration covers the address).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omniflow.errors import FailedPrecondition, NotFound, PermissionDenied
from omniflow.kv.arena import HEADER_BYTES
from omniflow.security import policy
from omniflow_services.kv_agent import metrics
from omniflow_services.kv_agent.nixl_channel import NixlChannel
from omniflow_services.kv_agent.pools import PagePool, Pools

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Grant:
    registration: Any
    requester: str
    deadline: float
    slots: int


class NixlGrants:
    """The live grants of one agent's NIXL channel, keyed by the pin they cover."""

    def __init__(self, nixl: NixlChannel, clock: Callable[[], float] = time.monotonic) -> None:
        self.nixl = nixl
        self._clock = clock
        self._grants: dict[str, _Grant] = {}

    def __len__(self) -> int:
        return len(self._grants)

    async def issue(
        self, pin_id: str, addresses: Sequence[int], nbytes: int, requester: str, deadline: float
    ) -> bytes:
        """Register ``nbytes`` at each address for ``requester`` until ``deadline`` (the
        pin's); returns the NIXL metadata of these regions only."""
        registration, metadata = await self.nixl.grant(addresses, nbytes)
        self._grants[pin_id] = _Grant(registration, requester, deadline, len(addresses))
        metrics.granted("issued", len(addresses))
        return metadata

    def check(self, pin_id: str, requester: str) -> bool:
        """Whether ``pin_id`` holds a grant; NotFound when it is another identity's (as
        an unknown pin: no hint that it exists)."""
        grant = self._grants.get(pin_id)
        if grant is None:
            return False
        if grant.requester != requester:
            raise NotFound(f"pin {pin_id!r} is unknown (released already, or it lapsed)")
        return True

    async def revoke(self, pin_id: str, outcome: str = "released") -> None:
        """Deregister the grant of ``pin_id`` (nothing when it has none)."""
        grant = self._grants.pop(pin_id, None)
        if grant is None:
            return
        metrics.granted(outcome, grant.slots)
        try:
            await self.nixl.revoke(grant.registration)
        except Exception as exc:  # the memory stays registered: say so, loudly
            log.error("nixl grant of pin %s: deregistration failed: %s", pin_id, exc)

    async def expire(self, now: float | None = None) -> int:
        """Revoke the grants past their deadline (before their pins lapse); returns how many."""
        now = self._clock() if now is None else now
        lapsed = [k for k, g in self._grants.items() if g.deadline <= now]
        for pin_id in lapsed:
            log.warning("nixl grant of pin %s lapsed; deregistered", pin_id)
            await self.revoke(pin_id, "lapsed")
        return len(lapsed)

    async def close(self) -> None:
        for pin_id in list(self._grants):
            await self.revoke(pin_id, "released")


def _requester() -> str:
    """The identity a grant is bound to: the caller's certificate ("" with auth off)."""
    who = policy.current()
    if not who.enforced:
        return ""
    if who.kind != "kv-agent" and not who.is_admin:
        raise PermissionDenied(
            f"a NIXL grant is for kv-agents pulling pages; {who.describe()} maps the arena"
        )
    return who.identity.uri if who.identity else ""


async def grant(
    grants: NixlGrants | None, pools: Pools, pool: PagePool, pin_id: str, slots: Sequence[int]
) -> bytes:
    """The grant of a pin just made for the calling agent: its slots registered with NIXL;
    returns the metadata to answer. The pin is released again when there is no grant."""
    try:
        if grants is None:
            raise FailedPrecondition("this agent has no NIXL channel (nixl not usable)")
        requester = _requester()
        deadline = pools.deadline(pin_id)
        base = pool.base_address + HEADER_BYTES
        addresses = [base + slot * pool.arena.stride for slot in slots]
        return await grants.issue(pin_id, addresses, pool.page_bytes, requester, deadline)
    except BaseException:
        pools.unpin(pin_id)
        raise


async def release(grants: NixlGrants | None, pools: Pools, pin_id: str) -> None:
    """``Unpin``: a granted pin only by the identity it was granted to, its NIXL regions
    deregistered before its pages are released."""
    if grants is not None and grants.check(pin_id, _requester_or_none()):
        await grants.revoke(pin_id)
    pools.unpin(pin_id)


def _requester_or_none() -> str:
    who = policy.current()
    return who.identity.uri if who.enforced and who.identity else ""


async def expire(grants: NixlGrants | None, pools: Pools) -> None:
    """The upkeep: lapsed grants revoked, then (at the same instant) lapsed pins released."""
    now = pools.now()
    if grants is not None:
        await grants.expire(now)
    pools.expire(now)
