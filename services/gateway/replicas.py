"""Every replica of a control-plane service the gateway calls (the coordinators), and calls
that fail over between them.

The gateway keeps every address discovery lists (relisted every ``RECHECK_S``, or at once
after a failure), the one that answered last first. A call that meets UNAVAILABLE (a dead,
restarting or not yet SERVING replica) marks that replica down for ``DOWN_S`` and is made
again at once on the next; when every replica failed, it waits (backoff from ``BACKOFF_S``
doubling to ``MAX_BACKOFF_S``) and tries again, until ``wait_s`` is spent: with one replica,
a request sent while it restarts waits for it instead of failing with 503. Only UNAVAILABLE
is retried: any other error would be the same on another replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from omniflow.backoff import Backoff
from omniflow.discovery import Registry
from omniflow.errors import Unavailable
from omniflow.rpc.interceptors import TracedChannel
from omniflow_services.gateway import metrics

log = logging.getLogger(__name__)

RECHECK_S = 5.0  # how long a discovery listing of a service's replicas is reused
DOWN_S = 2.0  # how long a replica that did not answer is passed over
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0

S = TypeVar("S")  # a stub
T = TypeVar("T")


class Replicas(Generic[S]):
    """The replicas of ``service`` (or the one configured address); see the module."""

    def __init__(
        self,
        registry: Registry | None,
        service: str,
        configured: str,
        channel: Callable[[str], TracedChannel],
        stub: Callable[[TracedChannel], S],
        wait_s: float,
    ) -> None:
        self.registry, self.service = registry, service
        self._configured = [a.strip() for a in configured.split(",") if a.strip()]
        self._channel, self._make_stub = channel, stub
        self.wait_s = wait_s
        self._known: list[str] = []
        self._checked = float("-inf")
        self._down: dict[str, float] = {}  # address -> loop time it was marked down
        self._last_good = ""
        self._stubs: dict[str, S] = {}

    async def addresses(self) -> list[str]:
        """Every known address; Unavailable when discovery lists none."""
        if self._configured:
            return self._configured
        loop = asyncio.get_running_loop()
        if loop.time() - self._checked >= RECHECK_S or not self._known:
            if self.registry is None:
                raise Unavailable(f"no discovery at hand to find a {self.service}")
            try:
                found = sorted({i.address for i in await self.registry.list(self.service)})
            except Exception as exc:  # discovery away: keep using what it said last
                if not self._known:
                    raise Unavailable(
                        f"no {self.service}: discovery does not answer ({exc})"
                    ) from exc
                log.warning("%s listing failed (%s); using the last one", self.service, exc)
            else:
                self._known, self._checked = found, loop.time()
        if not self._known:
            raise Unavailable(f"no {self.service} is registered in discovery")
        return self._known

    def order(self, known: list[str]) -> list[str]:
        """The replicas to try, in turn: the last that answered, the others not marked down,
        then those marked down (the longest down first: it may be back)."""
        now = asyncio.get_running_loop().time()
        up = [a for a in known if now - self._down.get(a, -DOWN_S) >= DOWN_S]
        up.sort(key=lambda a: a != self._last_good)
        down = sorted((a for a in known if a not in up), key=lambda a: self._down.get(a, 0.0))
        return up + down

    def mark_down(self, address: str) -> None:
        self._down[address] = asyncio.get_running_loop().time()
        self._checked = float("-inf")  # list again: a restarted replica may be elsewhere
        if self._last_good == address:
            self._last_good = ""
        metrics.FAILOVERS.labels(self.service).inc()

    def stub(self, address: str) -> S:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = self._make_stub(self._channel(address))
        return stub

    async def current(self) -> S:
        """The stub of the replica to use now (for calls that handle failures themselves)."""
        return self.stub(self.order(await self.addresses())[0])

    async def call(self, fn: Callable[[S], Awaitable[T]], wait_s: float | None = None) -> T:
        """``await fn(stub)`` on a replica, failing over and waiting as the module says
        (``wait_s``: how long, instead of the setting; 0 tries each replica once)."""
        budget = self.wait_s if wait_s is None else wait_s
        backoff = Backoff.within(budget, BACKOFF_S, MAX_BACKOFF_S)
        while True:
            try:
                known = await self.addresses()
            except Unavailable as exc:
                error: Unavailable = exc
            else:
                for address in self.order(known):
                    try:
                        result = await fn(self.stub(address))
                    except Unavailable as exc:
                        log.info("%s %s unavailable (%s)", self.service, address, exc)
                        self.mark_down(address)
                        error = exc
                        continue
                    self._last_good = address
                    return result
            if not await backoff.wait():
                raise Unavailable(
                    f"no {self.service} answered (tried for {self.wait_s:.1f} s at most, "
                    f"OMNIFLOW_GATEWAY_FAILOVER_WAIT_S): {error}"
                ) from error
