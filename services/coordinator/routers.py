"""The routers a coordinator uses: every one in discovery (or the configured one), with
failover. A call that finds its router unreachable marks it down for ``DOWN_S`` and is
retried at once on another; with every router down, the one that failed longest ago is
tried (it may be back: a supervised router restarts on its old address).

Only UNAVAILABLE fails over: it is what a dead or restarting router answers, and a Pick
that found no worker on one router would find none on another either (one retry costs
one RPC). Channels stay open per address, so a failover costs no connection setup.

When every router failed (one router, restarting), the call waits and is made again, with
backoff from ``BACKOFF_S`` doubling to ``MAX_BACKOFF_S``, for up to ``WAIT_S`` (a run's
deadline cancels it sooner): a supervised router is back within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from omniflow.api.router.v1 import router_pb2_grpc
from omniflow.backoff import Backoff
from omniflow.errors import Unavailable
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow_services.coordinator import metrics

log = logging.getLogger(__name__)

RECHECK_S = 2.0  # how long a discovery listing of the routers is reused
DOWN_S = 2.0  # how long a router that did not answer is passed over
WAIT_S = 10.0  # how long a call waits while no router answers
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
_IDEMPOTENT = ("omniflow.api.router.v1.RouterService/ListWorkers",)


class RouterPool:
    """Routers by address, the current one first; see the module docstring."""

    def __init__(
        self,
        list_routers: Callable[[], Awaitable[list[str]]],
        *,
        fixed: str = "",
        call_timeout_s: float = 10.0,
    ) -> None:
        self._list = list_routers
        self._fixed = fixed
        self._timeout_s = call_timeout_s
        self._known: list[str] = []
        self._checked = -RECHECK_S
        self._down: dict[str, float] = {}  # address -> loop time it was marked down
        self._stubs: dict[str, tuple[TracedChannel, router_pb2_grpc.RouterServiceStub]] = {}
        self.stub = FailoverStub(self)

    async def addresses(self) -> list[str]:
        if self._fixed:
            return [self._fixed]
        loop = asyncio.get_running_loop()
        if loop.time() >= self._checked + RECHECK_S or not self._known:
            try:
                self._known = sorted(await self._list())
                self._checked = loop.time()
            except Exception as exc:  # discovery away: keep using what it said last
                if not self._known:
                    raise Unavailable(f"no router: discovery does not answer ({exc})") from exc
                log.warning("router listing failed (%s); using the last one", exc)
        if not self._known:
            raise Unavailable("no router is registered in discovery")
        return self._known

    async def current(self) -> tuple[str, router_pb2_grpc.RouterServiceStub]:
        """The router to use now: the first not marked down, else the longest down."""
        known = await self.addresses()
        now = asyncio.get_running_loop().time()
        up = [a for a in known if now - self._down.get(a, -DOWN_S) >= DOWN_S]
        address = up[0] if up else min(known, key=lambda a: self._down.get(a, 0.0))
        return address, self._stub(address)

    def mark_down(self, address: str) -> None:
        self._down[address] = asyncio.get_running_loop().time()
        self._checked = -RECHECK_S  # list again: a restarted router may be elsewhere
        metrics.ROUTER_FAILOVERS.inc()

    def _stub(self, address: str) -> router_pb2_grpc.RouterServiceStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = open_channel(
                address,
                default_timeout_s=self._timeout_s,
                idempotent=_IDEMPOTENT,
                max_in_flight=None,
            )
            entry = self._stubs[address] = (channel, router_pb2_grpc.RouterServiceStub(channel))
        return entry[1]

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._stubs.clear()


class FailoverStub:
    """What callers use as a RouterServiceStub: each unary method fails over."""

    def __init__(self, pool: RouterPool) -> None:
        self._pool = pool

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, **kw: Any) -> Any:
            pool = self._pool
            # A run's own deadline cancels the wait sooner.
            backoff = Backoff.within(WAIT_S, BACKOFF_S, MAX_BACKOFF_S)
            tried: set[str] = set()
            while True:
                address, stub = await pool.current()
                try:
                    return await getattr(stub, method)(request, **kw)
                except Unavailable as exc:
                    pool.mark_down(address)
                    tried.add(address)
                    if len(await pool.addresses()) > len(tried):
                        log.info("router %s unavailable (%s); failing over", address, exc)
                        continue
                    # Every router failed: wait for one to be back (a restart), then again.
                    if not await backoff.wait():
                        raise
                    tried.clear()

        return call
