"""replies.joined: a chat stream's role chunks leave with its first output, as one write."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from omniflow.errors import Unavailable
from omniflow_services.gateway.replies import joined


async def _events(*items: bytes | Exception) -> AsyncIterator[bytes]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


async def _all(events: AsyncIterator[bytes]) -> list[bytes]:
    return [e async for e in events]


async def test_the_leading_events_go_with_the_next_one() -> None:
    got = await _all(joined(_events(b"r0", b"r1", b"c0", b"c1", b"done"), 2))
    assert got == [b"r0r1c0", b"c1", b"done"]


async def test_leading_events_with_nothing_after_them_still_go() -> None:
    assert await _all(joined(_events(b"r0", b"r1"), 2)) == [b"r0r1"]
    assert await _all(joined(_events(b"r0"), 2)) == [b"r0"]
    assert await _all(joined(_events(b"a", b"b"), 0)) == [b"a", b"b"]


async def test_an_error_before_the_first_output_is_raised_not_swallowed() -> None:
    with pytest.raises(Unavailable):
        await _all(joined(_events(b"r0", Unavailable("worker gone")), 1))
