"""The one retry backoff (``omniflow.backoff``): doubling, capped, jittered, deadlined."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from omniflow.backoff import Backoff


def test_delays_double_up_to_the_cap_without_jitter() -> None:
    b = Backoff(0.1, 1.0, jitter=0.0)
    assert [b.next() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    b.reset()
    assert b.next() == pytest.approx(0.1)


def test_jitter_only_shortens_a_delay_and_spreads_them() -> None:
    random.seed(7)
    delays = [Backoff(1.0, 1.0, jitter=0.2).next() for _ in range(200)]
    assert all(d is not None and 0.8 <= d <= 1.0 for d in delays)
    assert len({round(d, 6) for d in delays if d is not None}) > 100


def test_a_delay_past_the_deadline_is_none_and_not_used_up() -> None:
    b = Backoff(0.5, 2.0, jitter=0.0, deadline=time.monotonic() + 60)
    assert b.next() == pytest.approx(0.5)
    assert b.left_s() is not None and 59 < b.left_s() <= 60  # type: ignore[operator]
    b.deadline = time.monotonic() + 0.9  # 1.0 does not fit any more
    assert b.next() is None
    b.deadline = time.monotonic() + 60
    assert b.next() == pytest.approx(1.0)  # the refused delay is the next one offered
    assert Backoff.within(0.0).next() is None  # no budget: not even one wait
    assert Backoff(0.1, 1.0).left_s() is None


def test_wait_sleeps_within_the_deadline_then_refuses() -> None:
    async def go() -> list[bool]:
        b = Backoff(0.01, 1.0, jitter=0.0, deadline=time.monotonic() + 0.5)
        return [await b.wait() for _ in range(8)]

    waited = asyncio.run(go())
    # 0.01 + 0.02 + ... fit until the next doubling passes the deadline; then never again.
    assert waited[0] and not waited[-1]
    assert waited == sorted(waited, reverse=True)


@pytest.mark.parametrize(("initial", "cap", "jitter"), [(0, 1, 0.1), (2, 1, 0.1), (1, 1, 1.0)])
def test_bad_parameters_are_refused(initial: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="0 < initial_s <= max_s"):
        Backoff(initial, cap, jitter)
