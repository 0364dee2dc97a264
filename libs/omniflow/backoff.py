"""The one retry backoff: delays doubling from ``initial_s`` to ``max_s``, each shortened by
a random part of up to ``jitter`` of itself (so that peers which failed together do not
retry together), within an optional deadline.

    backoff = Backoff(0.1, 2.0, deadline=time.monotonic() + budget_s)
    while True:
        try:
            return await attempt()
        except Unavailable:
            if not await backoff.wait():  # the next delay would pass the deadline
                raise

``next()`` gives the delay without sleeping (for loops that sleep elsewhere or compare it
with a clock, like the supervisor's); ``reset()`` after a success starts again from
``initial_s``.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Doubling delays with jitter and a cap; ``deadline`` is a ``time.monotonic()`` time."""

    initial_s: float = 0.1
    max_s: float = 2.0
    jitter: float = 0.2
    deadline: float | None = None
    factor: float = 2.0
    _base: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s) or not (0 <= self.jitter < 1):
            raise ValueError(
                f"backoff needs 0 < initial_s <= max_s and 0 <= jitter < 1; got "
                f"{self.initial_s}, {self.max_s}, {self.jitter}"
            )
        self._base = self.initial_s

    @classmethod
    def within(cls, budget_s: float, initial_s: float = 0.1, max_s: float = 2.0) -> Backoff:
        """A backoff whose deadline is ``budget_s`` from now."""
        return cls(initial_s, max_s, deadline=time.monotonic() + budget_s)

    def reset(self) -> None:
        """The next delay is ``initial_s`` again (after a success)."""
        self._base = self.initial_s

    def left_s(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def next(self) -> float | None:
        """The next delay, and the one after doubles (up to ``max_s``); None when sleeping
        it would pass the deadline (the delay is not used up then)."""
        delay = self._base * (1 - self.jitter * random.random())
        left = self.left_s()
        if left is not None and delay > left:
            return None
        self._base = min(self._base * self.factor, self.max_s)
        return delay

    async def wait(self) -> bool:
        """Sleep the next delay; False at once when it would pass the deadline."""
        delay = self.next()
        if delay is None:
            return False
        await asyncio.sleep(delay)
        return True
