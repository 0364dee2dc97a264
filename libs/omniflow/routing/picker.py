"""One pick of a worker, wherever it is made: the worker table (``table``), the KV index's
answer for kv_aware (``prefix``), and the load and health polled from the workers.

The router's ``Pick`` serves it to its callers (the coordinator); the gateway runs it in
its own process (as Dynamo's KV router runs inside its frontend), so that a request's pick
is a table lookup plus, for kv_aware, the one prefix match — no Pick round trip. Each
process counts the calls it picked (``begin`` / ``finish``); what the others send a worker
reaches it through the queue the worker reports (``GetLoad``, polled every
``health_interval_s``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypedDict, Unpack

from omniflow.discovery import Registry
from omniflow.errors import InvalidArgument, OmniflowError
from omniflow.kv.index_store import OwnerMatch
from omniflow.records import build
from omniflow.routing.prefix import PrefixIndex, prefix_index
from omniflow.routing.settings import PickSettings
from omniflow.routing.table import PickResult, WorkerTable
from omniflow.workers import WORKER_SERVICE, WorkerRecord, worker_from_instance

log = logging.getLogger(__name__)

#: A worker's queue (running + waiting requests), or None when it did not answer.
LoadOf = Callable[[WorkerRecord], Awaitable[int | None]]


def acknowledged(node: str, blocks: int) -> OwnerMatch:
    """The agent of ``node`` as holding all ``blocks`` in its host tier: the caller knows it
    acknowledged storing them (a prefill_only reply), though the index may not say so yet."""
    return OwnerMatch(f"acknowledged@{node}", node, "", "agent", blocks, (0, blocks, 0))


class PickOptions(TypedDict, total=False):
    """What a pick may weigh besides its role and strategy; every key is optional."""

    exclude: Iterable[str]  # worker ids not to pick (a failed attempt's)
    operation: str  # only workers that serve it ("" any)
    session_key: str  # sticky: one session, one worker
    namespace: bytes  # kv_aware: the KV namespace of ``hashes``
    hashes: list[bytes]  # kv_aware: the prompt's block hashes
    temperature: float  # kv_aware: softmax temperature over costs (0: the settings')
    stored_node: str  # kv_aware: a node whose agent acknowledged every block of ``hashes``


class Picker:
    """The pick policy of one process: its worker table and its way to the KV index."""

    def __init__(self, settings: PickSettings, *, match_alone: bool = True) -> None:
        """``match_alone``: ask the index also when one worker is a candidate (the router
        does: its answer reports the match); without it such a pick weighs nothing and asks
        nothing, the same worker one index round trip sooner (the gateway)."""
        self.settings = settings
        self.match_alone = match_alone
        # The table's keyword parameters are settings of the same names (breaker, link).
        self.table = build(WorkerTable, settings)
        self.index: PrefixIndex | None = None

    def open_index(self, resolve: Callable[[], Awaitable[str]]) -> None:
        """Reach the KV index the settings name; ``resolve`` gives the kv-index's address."""
        s = self.settings
        self.index = prefix_index(
            s.kv_index, resolve, s.redis_url, s.kv_index_timeout_s, s.kv_key_prefix
        )

    async def pick(
        self, role: str, strategy: str = "", **options: Unpack[PickOptions]
    ) -> PickResult:
        """One worker of ``role`` by ``strategy`` ("": the role's default); a ``stored_node``
        is counted as holding the blocks before the index knows. The caller ``begin``s the
        call on the table and ``finish``es it with its outcome."""
        if not role:
            raise InvalidArgument("role is required (e.g. 'llm', 'encoder', 'diffusion')")
        strategy = strategy or self.settings.strategy_for(role)
        exclude = tuple(options.get("exclude", ()))
        operation = options.get("operation", "")
        hashes = options.get("hashes") or []
        stored_node = options.get("stored_node", "")
        reach, fallback = None, ""
        cands = None
        if strategy == "kv_aware":
            if not self.match_alone:
                cands = self.table.candidates(role, exclude, operation)
            if cands is None or len(cands) > 1:
                reach, fallback = await self._match(options.get("namespace", b""), hashes)
            else:
                reach = []
            if stored_node and hashes:
                reach = [*(reach or []), acknowledged(stored_node, len(hashes))]
        return self.table.pick(
            role,
            strategy,
            exclude,
            operation,
            session_key=options.get("session_key", ""),
            reach=reach,
            prompt_blocks=len(hashes),
            temperature=options.get("temperature") or self.settings.kv_temperature,
            load_weight=self.settings.kv_load_weight,
            fallback_reason=fallback,
            cands=cands,
        )

    async def _match(
        self, namespace: bytes, hashes: list[bytes]
    ) -> tuple[list[OwnerMatch] | None, str]:
        if not hashes:
            return [], ""
        if self.index is None:
            self.table.count("kv_fallback_off")
            return None, "kv index is off: load only"
        try:
            # asyncio.timeout, not wait_for: no task made and scheduled for every pick.
            async with asyncio.timeout(self.settings.kv_index_timeout_s):
                reach = await self.index.match(namespace, hashes)
        except TimeoutError:
            self.table.count("kv_fallback_timeout")
            return None, "kv index timed out: load only"
        except OmniflowError as exc:
            self.table.count("kv_fallback_error")
            return None, f"kv index failed ({exc.code_name}): load only"
        return reach, ""

    async def follow(self, registry: Registry, first: asyncio.Future[None] | None = None) -> None:
        """Keep the table to discovery's workers (``first`` is set once the first listing
        is in); a discovery hiccup keeps the last table and retries. Runs until cancelled."""
        while True:
            try:
                async for instances in registry.watch(WORKER_SERVICE):
                    self.table.replace(worker_from_instance(i) for i in instances)
                    log.debug("workers: %s", self.table.roles())
                    if first is not None and not first.done():
                        first.set_result(None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker watch failed (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def poll_health(self, load_of: LoadOf) -> None:
        """Every ``health_interval_s``: each worker's reported queue, and whether it answers
        at all. Runs until cancelled."""
        while True:
            workers = self.table.list()
            queues = await asyncio.gather(*(load_of(w) for w in workers))
            for w, queue in zip(workers, queues, strict=True):
                self.table.set_health(w.worker_id, queue is not None, queue or 0)
            await asyncio.sleep(self.settings.health_interval_s)

    async def close(self) -> None:
        if self.index is not None:
            await self.index.close()
            self.index = None
