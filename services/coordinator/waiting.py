"""Calls that wait out a restarting worker instead of failing the run.

A worker that dies is restarted by its supervisor (or its orchestrator) on its old
address; until it is back a call of its role meets one of three answers, none of which
says anything about the operation itself:

- UNAVAILABLE from the worker's transport or gate (:func:`restarting`): its port refuses
  connections, or it is up and loading its model (the serving gate answers UNAVAILABLE
  until SERVING), or it died before the first chunk of its answer (an UNAVAILABLE the
  operation itself raised is the node's retry policy's to handle);
- NOT_FOUND from the router's Pick ("no live worker of role ..."): its registration expired
  while it was down, and a role this coordinator has called before has no worker for now;
- UNAVAILABLE from the Pick itself (no router answers; ``routers.py`` waits for that one).

:class:`WaitingCaller` wraps any :class:`~omniflow_services.coordinator.calls.WorkerCaller`
and, on those answers, waits with the library's backoff (``BACKOFF_S`` doubling to
``MAX_BACKOFF_S``)
and picks and calls again, for up to ``wait_s`` and never past the call's own deadline
(``CallRequest.timeout_s``; the run engine's timeout around the call cuts it sooner). This
is independent of the node's retry policy, which is for failures of the operation: with
one worker of a role and no retry policy, a run sent while that worker restarts waits for
it instead of failing. A call that already passed a chunk on (streamed text reached the
run's events or a consumer) is not made again here: its retry, if any, is the node's.
A role never seen by this coordinator is not waited for (a typo fails at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from omniflow.backoff import Backoff
from omniflow.errors import NotFound, OmniflowError, Unavailable
from omniflow_services.coordinator.calls import CallRequest, ChunkSink, Target, WorkerCaller

log = logging.getLogger(__name__)

BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


# What a worker that is down or starting answers, as opposed to an operation's own
# UNAVAILABLE (the worker is up and says "not now" itself: the node's retry policy's call).
# The serving gate's refusal (``omniflow.rpc.interceptors.ServingGate``), and what gRPC's
# transport says when no server is there or the connection broke.
_RESTARTING = (
    "is not serving",
    "failed to connect",
    "connection refused",
    "socket closed",
    "connection reset",
    "broken pipe",
    "goaway",
    "stream removed",
    "endpoint closing",
    "rst_stream",
)


def restarting(exc: OmniflowError) -> bool:
    """Whether ``exc`` from a worker says that it is down, restarting or loading."""
    text = str(exc).lower()
    return isinstance(exc, Unavailable) and any(m in text for m in _RESTARTING)


class WaitingCaller:
    """A WorkerCaller whose picks and calls wait out a restarting worker (module doc)."""

    def __init__(self, inner: WorkerCaller, *, wait_s: float = 30.0) -> None:
        self.inner = inner
        self.wait_s = wait_s
        self._seen: set[str] = set()  # roles a pick found a worker of
        # A call made again on another worker: the engine reports the outcome of the
        # target it picked, which is passed on as the target that answered.
        self._moved: dict[int, Target | None] = {}  # None: reported here already

    def __getattr__(self, name: str) -> Any:  # hinter, close, ...
        return getattr(self.inner, name)

    def pick_reads(self, role: str, operation: str, strategy: int) -> tuple[str, ...]:
        return self.inner.pick_reads(role, operation, strategy)

    def _backoff(self, req: CallRequest) -> Backoff:
        wait = self.wait_s if req.timeout_s is None else min(self.wait_s, req.timeout_s)
        return Backoff(BACKOFF_S, MAX_BACKOFF_S, deadline=time.monotonic() + wait)

    def _waits(self, exc: OmniflowError, req: CallRequest, exclude: tuple[str, ...]) -> bool:
        if isinstance(exc, Unavailable):  # no router answers (``routers.py`` waited already)
            return True
        # None left once the workers that failed this node are excluded: nothing to wait for.
        return (
            isinstance(exc, NotFound)
            and not exclude
            and req.role in self._seen
            and "no live worker" in str(exc)
        )

    @staticmethod
    async def _pause(backoff: Backoff, exc: OmniflowError, what: str) -> None:
        """Sleep the next delay, or raise ``exc`` when it would pass the deadline."""
        log.info("%s: %s; waiting for a worker", what, exc)
        if not await backoff.wait():
            raise exc

    async def _pick(self, req: CallRequest, exclude: tuple[str, ...], backoff: Backoff) -> Target:
        while True:
            try:
                target = await self.inner.pick(req, exclude)
            except OmniflowError as exc:
                if self.wait_s <= 0 or not self._waits(exc, req, exclude):
                    raise
                await self._pause(backoff, exc, f"pick for {req.role}")
                continue
            self._seen.add(req.role)
            return target

    async def pick(self, req: CallRequest, exclude: tuple[str, ...]) -> Target:
        return await self._pick(req, exclude, self._backoff(req))

    async def invoke(
        self, target: Target, req: CallRequest, on_chunk: ChunkSink | None
    ) -> dict[str, Any]:
        passed = False

        async def sink(output: str, chunk: Any) -> None:
            nonlocal passed
            passed = True
            if on_chunk is not None:
                await on_chunk(output, chunk)

        picked: Target = target
        now: Target | None = target
        backoff = self._backoff(req)
        while True:
            try:
                assert now is not None
                result = await self.inner.invoke(now, req, sink)
            except asyncio.CancelledError:
                raise  # the engine reports nothing for a cancelled call
            except Unavailable as exc:
                try:
                    if passed or self.wait_s <= 0 or not restarting(exc):
                        raise
                    await self._pause(backoff, exc, f"worker {now.worker_id}")
                    # The same worker once back (a restart keeps its address) or another.
                    await self.inner.report(now, False, 0.0, "UNAVAILABLE")
                    now = None  # reported: a pick that fails now leaves nothing to report
                    try:
                        now = await self._pick(req, (), backoff)
                    except OmniflowError as gone:  # the worker's failure is the news
                        why = f"{exc} (no worker of {req.role} since: {gone})"
                        raise Unavailable(why) from gone
                except OmniflowError:
                    self._move(picked, now)
                    raise
                continue
            except BaseException:
                self._move(picked, now)
                raise
            self._move(picked, now)
            return result

    def _move(self, picked: Target, now: Target | None) -> None:
        if now is not picked:
            self._moved[id(picked)] = now

    async def report(self, target: Target, ok: bool, latency_ms: float, code: str) -> None:
        actual = self._moved.pop(id(target), target)
        if actual is not None:
            await self.inner.report(actual, ok, latency_ms, code)
