"""Helpers for the discovery tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from omniflow.discovery import ServiceInstance

# A liveness bound, not a timing assertion: a change that never comes fails the
# test instead of hanging it. Generous because the machines are shared and slow.
EVENTUALLY_S = 30.0


async def next_until(
    it: AsyncIterator[list[ServiceInstance]],
    predicate: Callable[[list[ServiceInstance]], bool],
    timeout_s: float = EVENTUALLY_S,
) -> list[ServiceInstance]:
    """Advance a watch until it yields a listing that satisfies ``predicate``."""
    async with asyncio.timeout(timeout_s):
        while True:
            listing = await anext(it)
            if predicate(listing):
                return listing


def ids(listing: list[ServiceInstance]) -> list[str]:
    return [inst.instance_id for inst in listing]
