"""Runs: submission with a bounded number in progress, live events, records in Redis.

Key layout (Redis; a run's keys carry its tenant: ``name`` is its id in its tenant's
namespace, see ``run_keys``):

- ``omniflow:run:{name}``: the ``Run`` record, serialized; rewritten as the run moves.
- ``omniflow:run:{name}:events``: a list of serialized ``RunEvent``, in sequence order.
- ``omniflow:runs:active``: hash run name → id of the coordinator running it.
- ``omniflow:coordinator:{id}:lease``: present (with a TTL) while that coordinator lives.

Events are kept in memory while a run is live and flushed to Redis in small batches
(every ``flush_interval_s``, in one pipeline per run), so a hop costs no Redis round trip.
The final record and every event, ``RunFinished`` included, are in Redis before
``RunFinished`` reaches any client: a run a client saw finish is never reported
interrupted by a coordinator that restarts. Finished runs are kept for ``run_ttl_s``.

A run is reported finished only once its final record is written: the final write is
retried for ``record_retry_s``; if Redis still does not take it, the run is reported
FAILED with an ``UNAVAILABLE: ...`` reason instead (never SUCCEEDED unrecorded), and that
failed record is written as soon as Redis answers again.

Adoption: a run's entry in ``omniflow:runs:active`` is its claim, valid while its
coordinator's lease lives (one lease per coordinator covers all its runs: one write per
period instead of one per run). Every coordinator sweeps the active runs each
``lease_ttl_s / 3``; a run whose coordinator's lease is missing on two sweeps in a row
(or that is this coordinator's own, from before a restart) is claimed atomically. With
``resume_orphans`` the adopter runs it again from its recorded inputs, under the same id
(once: ``MAX_RESUMES``), its events continuing the recorded sequence; a run that cannot
be resumed (never flushed, its workflow version gone, resumed before, no capacity) is
marked FAILED with the reason "interrupted: coordinator ... restarted or died while the
run was in progress"; its stream ends with that RunFinished event. A run is therefore
never RUNNING for longer than about the lease TTL after its coordinator died. Finished
runs answer GetRun and StreamRunEvents from Redis after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import trace

from omniflow import telemetry
from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.backoff import Backoff
from omniflow.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from omniflow.security import policy
from omniflow.tasks import stop_task
from omniflow.values import VType, check_type, from_python, to_python
from omniflow_services.coordinator import adoption, metrics, run_keys
from omniflow_services.coordinator.adoption import lease_key
from omniflow_services.coordinator.caller import node_overrides
from omniflow_services.coordinator.calls import (
    PickAhead,
    WorkerCaller,
    pick_entries,
    release_picks,
)
from omniflow_services.coordinator.catalogue import WorkflowCatalogue
from omniflow_services.coordinator.executor import (
    Executor,
    NodeFailed,
    NodeLimits,
    current_trace_id,
)
from omniflow_services.coordinator.limits import RunLimits, check_inputs_size, check_run_id
from omniflow_services.coordinator.live import LiveRun, now_ms
from omniflow_services.coordinator.run_keys import ACTIVE_KEY, events_key, run_key, run_name

log = logging.getLogger(__name__)


# One script per flush (a third cheaper than a pipeline of its commands): append the new
# events, store the record; on the final write (a TTL given) expire both and leave the
# active set. KEYS: record, events, active set. ARGV: record, ttl (0: not final), run id,
# events already written before these, events... A retry after a lost reply pushes only
# what the list does not have yet.
_WRITE = """
local first = 5 + math.max(redis.call('LLEN', KEYS[2]) - tonumber(ARGV[4]), 0)
for i = first, #ARGV, 1000 do  -- in slices: unpack() has a stack limit
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('HDEL', KEYS[3], ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""


class RunManager:
    """Starts, tracks, cancels and records runs; the coordinator's core for runs."""

    def __init__(
        self,
        redis: aioredis.Redis,
        caller: WorkerCaller,
        *,
        owner_id: str,
        max_runs: int = 256,
        run_ttl_s: float = 86_400.0,
        max_inline_bytes: int = 4 * 1024 * 1024,
        flush_interval_s: float = 0.05,
        lease_ttl_s: float = 10.0,
        record_retry_s: float = 5.0,
        limits: RunLimits | None = None,
        resume_orphans: bool = True,
        roles_served: Callable[[], Awaitable[set[str]]] | None = None,
        adopt_wait_s: float = 120.0,
    ) -> None:
        self.redis, self.caller, self.owner_id = redis, caller, owner_id
        self.catalogue = WorkflowCatalogue(redis, limits)
        self.max_runs, self.run_ttl_s = max_runs, run_ttl_s
        self.max_inline_bytes = max_inline_bytes
        self.flush_interval_s, self.lease_ttl_s = flush_interval_s, lease_ttl_s
        self.record_retry_s = record_retry_s
        self.resume_orphans = resume_orphans
        #: The roles some healthy worker serves now (an adopted run waits for its own).
        self.roles_served, self.adopt_wait_s = roles_served, adopt_wait_s
        self.bounds = limits or RunLimits(max_inline_bytes=max_inline_bytes)
        self.live: dict[str, LiveRun] = {}
        self.tenant_runs: dict[str, int] = {}  # tenant -> its runs in self.live
        # Runs reported failed because their final record could not be written; the
        # flush loop writes them once Redis answers (GetRun answers from here meanwhile).
        self.unrecorded: dict[str, tuple[LiveRun, cpb.RunEvent]] = {}
        self.suspects: set[tuple[str, str]] = set()  # (run, owner) seen without a lease
        self.claim = redis.register_script(adoption.CLAIM)
        self.limits: dict[str, NodeLimits] = {}
        self._background: list[asyncio.Task[None]] = []
        self._write = redis.register_script(_WRITE)
        self._releases: set[asyncio.Task[None]] = set()

    # -- lifecycle
    async def start(self) -> int:
        """Take the lease, fail runs orphaned by a dead coordinator; returns how many."""
        await self._refresh_lease()
        orphaned = await self.recover()
        self._background = [
            asyncio.create_task(self._lease_loop()),
            asyncio.create_task(self._flush_loop()),
        ]
        return orphaned

    async def recover(self, confirm: bool = False) -> int:
        """Adopt the active runs whose coordinator is gone (see ``adoption``)."""
        return await adoption.recover(self, confirm)

    async def _refresh_lease(self) -> None:
        await self.redis.set(lease_key(self.owner_id), "1", px=int(self.lease_ttl_s * 1000))

    async def _lease_loop(self) -> None:
        period = self.lease_ttl_s / 3
        delay = period
        while True:
            await asyncio.sleep(delay)
            try:
                await self._refresh_lease()
                await self.recover(confirm=True)
                delay = period
            except Exception as exc:  # Redis away: retry soon, so the lease is renewed
                log.warning("lease refresh or adoption sweep failed: %s", exc)
                delay = min(0.2, period)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            for name, (live, finished) in list(self.unrecorded.items()):
                try:
                    await self._flush(live, finished)
                except Exception:
                    break  # Redis still away: the next period tries again
                del self.unrecorded[name]
                log.info("run %s: its failed record is written now", live.run.run_id)
            for live in list(self.live.values()):
                if live.flushed < len(live.events):
                    try:
                        await self._flush(live)
                    except Exception as exc:
                        log.warning("flush of run %s failed: %s", live.run.run_id, exc)

    async def _flush(self, live: LiveRun, last: cpb.RunEvent | None = None) -> None:
        """Write the record and the events not yet written, in one round trip; with
        ``last`` (the RunFinished event, not yet published), the final write."""
        async with live.flush_lock:  # the periodic and the final flush never interleave
            if live.closed:
                return  # a periodic flush that waited for the final one: nothing to add
            key = run_key(live.key)
            pending = live.events[live.flushed :]
            if last is not None and not (pending and pending[-1] is last):
                pending.append(last)  # not yet published (an unrecorded run's already is)
            await self._write(
                keys=[key, events_key(live.key), ACTIVE_KEY],
                args=[
                    live.record().SerializeToString(),
                    int(self.run_ttl_s) if last is not None else 0,
                    live.key,
                    live.flushed,
                    *[e.SerializeToString() for e in pending],
                ],
            )
            live.flushed += len(pending) - (last is not None)
            live.closed = last is not None

    async def stop(self) -> None:
        """Cancel live runs (recorded as cancelled by shutdown), stop background tasks."""
        for live in list(self.live.values()):
            live.cancel_reason = "coordinator shutting down"
            if live.task is not None:
                live.task.cancel()
        tasks = [lv.task for lv in self.live.values() if lv.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for task in self._background:
            await stop_task(task)
        with contextlib.suppress(Exception):
            await self.redis.delete(f"omniflow:coordinator:{self.owner_id}:lease")

    # -- runs
    def _check_inputs(
        self, graph: cpb.WorkflowGraph, inputs: Mapping[str, common_pb2.Value]
    ) -> dict[str, Any]:
        check_inputs_size(self.bounds, inputs)
        ports = {p.name: p for p in graph.inputs}
        for name in inputs:
            if name not in ports:
                raise InvalidArgument(
                    f"workflow {graph.name!r} has no input {name!r}; inputs: "
                    f"{', '.join(ports) or 'none'}"
                )
        values: dict[str, Any] = {}
        for name, port in ports.items():
            if name not in inputs:
                if not port.optional:
                    raise InvalidArgument(f"input {name!r} of {graph.name!r} is required")
                continue
            value = to_python(inputs[name])
            check_type(value, VType(port.type), f"input {name!r}")
            values[name] = value
        return values

    async def submit(
        self,
        workflow: str,
        version: int,
        inputs: Mapping[str, common_pb2.Value],
        deadline_ms: int = 0,
        run_id: str = "",
        node_params: Mapping[str, common_pb2.StructValue] | None = None,
    ) -> str:
        """Start a run; returns its id at once. RESOURCE_EXHAUSTED when at the limit (of
        every run, or of the caller's tenant). ``node_params``: see ``node_overrides``."""
        tenant = self.caller_tenant()
        if run_id:
            check_run_id(run_id)
            name = run_name(tenant, run_id)
            if name in self.live or await run_keys.known(self.redis, name):
                return run_id  # idempotent resubmission (a client failing over resubmits)
        if len(self.live) >= self.max_runs:
            raise ResourceExhausted(
                f"{len(self.live)} runs in progress, the limit is {self.max_runs} "
                "(OMNIFLOW_COORDINATOR_MAX_RUNS); retry later"
            )
        share = self.bounds.tenant_max_runs
        if tenant and share and self.tenant_runs.get(tenant, 0) >= share:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {self.tenant_runs[tenant]} runs in progress, its limit "
                f"is {share} (OMNIFLOW_COORDINATOR_TENANT_MAX_RUNS); retry when one finishes"
            )
        span = telemetry.tracer().start_span(f"run {workflow}")
        early: dict[str, PickAhead] = {}
        try:
            with trace.use_span(span, end_on_exit=False):
                guess = self.catalogue.guess(workflow) if version == 0 else None
                if guess is not None:
                    # The version is most likely the one seen last: its first picks go out
                    # while Redis says which version is the latest.
                    with contextlib.suppress(InvalidArgument):
                        early = pick_entries(
                            self.caller, list(guess.nodes), self._check_inputs(guess, inputs)
                        )
                graph = await self.catalogue.get(workflow, version)
                if early and graph is not guess:
                    self._release(early)
                    early = {}
                values = self._check_inputs(graph, inputs)
                node_overrides(graph, node_params or {})  # checked before the run starts
                run_id = run_id or uuid.uuid4().hex
                if run_name(tenant, run_id) in self.live:
                    self._release(early)
                    span.end()
                    return run_id  # the same id submitted twice at once
                live = self._start(graph, inputs, values, deadline_ms, run_id, span, early, tenant)
                for name, params in (node_params or {}).items():  # recorded for an adopter
                    live.run.node_params[name].CopyFrom(params)
                live.tenant = tenant
                self.tenant_runs[tenant] = self.tenant_runs.get(tenant, 0) + 1
        except BaseException as exc:
            self._release(early)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            span.end()
            raise
        assert live.registered is not None and live.task is not None
        try:
            await asyncio.shield(live.registered)
        except Exception as exc:
            live.cancel_reason = f"could not record the run in Redis: {exc}"
            live.task.cancel()
            # Untracked now, not once its task ends: the caller's retry of the same id (Redis
            # back) starts the run anew instead of following this cancelled one.
            self._untrack(live)
            raise Unavailable(f"run {run_id} not started: Redis does not answer ({exc})") from exc
        return run_id

    @staticmethod
    def caller_tenant() -> str:
        """The caller's tenant, when the policy enforces one ("" : no share of its own)."""
        who = policy.current()
        return who.tenant if who.enforced else ""

    def _untrack(self, live: LiveRun) -> None:
        if self.live.get(live.key) is live:  # not a newer run of the same id
            self.live.pop(live.key)
        if live.tenant:
            left = self.tenant_runs.get(live.tenant, 0) - 1
            if left > 0:
                self.tenant_runs[live.tenant] = left
            else:
                self.tenant_runs.pop(live.tenant, None)
            live.tenant = ""

    def _start(
        self,
        graph: cpb.WorkflowGraph,
        inputs: Mapping[str, common_pb2.Value],
        values: dict[str, Any],
        deadline_ms: int,
        run_id: str,
        span: trace.Span,
        early: dict[str, PickAhead],
        tenant: str = "",
    ) -> LiveRun:
        """Register and start a run of ``tenant`` (called inside its span's context)."""
        run = cpb.Run(
            run_id=run_id,
            workflow=graph.name,
            version=graph.version,
            state=cpb.RUN_STATE_RUNNING,
            inputs=dict(inputs),
            created_unix_ms=now_ms(),
        )
        span.set_attribute("omniflow.run_id", run_id)
        run.trace_id = current_trace_id()
        live = LiveRun(run)
        live.key = run_name(tenant, run_id)
        self.live[live.key] = live
        metrics.run_started()
        # The run starts while its active entry and first record are written (its first
        # Pick overlaps the Redis round trip); submit returns the id only once both are in
        # Redis, so that a run a client knows of is always accounted for after a crash,
        # and can be resumed from its inputs by whoever adopts it.
        live.registered = asyncio.ensure_future(self._register(live))
        # The task inherits this context: every node call is a child of the run span.
        deadline_ms = deadline_ms or graph.default_deadline_ms
        live.task = asyncio.create_task(
            self._execute(live, graph, values, deadline_ms, span, early)
        )
        return live

    async def _register(self, live: LiveRun) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(ACTIVE_KEY, live.key, self.owner_id)
            pipe.set(run_key(live.key), live.run.SerializeToString(), nx=True)
            await pipe.execute()

    def _release(self, early: dict[str, PickAhead]) -> None:
        if early:
            task = asyncio.create_task(release_picks(self.caller, early))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _execute(
        self,
        live: LiveRun,
        graph: cpb.WorkflowGraph,
        values: dict[str, Any],
        deadline_ms: int,
        span: trace.Span,
        early: dict[str, PickAhead],
    ) -> None:
        loop = asyncio.get_running_loop()
        cap = self.bounds.max_run_deadline_ms  # no run holds a slot for ever
        if cap:
            deadline_ms = min(deadline_ms, cap) if deadline_ms else cap
        deadline = loop.time() + deadline_ms / 1000 if deadline_ms else None
        limits = self.limits.setdefault(f"{graph.name}:{graph.version}", NodeLimits())
        executor = Executor(
            self.caller,
            live,
            live.run.run_id,
            limits,
            deadline,
            early,
            max_backoff_s=self.bounds.max_retry_backoff_ms / 1000,
            overrides=node_overrides(graph, live.run.node_params),
        )
        state, error, outputs = cpb.RUN_STATE_SUCCEEDED, "", {}
        try:
            async with asyncio.timeout_at(deadline):
                outputs = await executor.run(values, list(graph.nodes), graph.outputs)
        except NodeFailed as exc:
            state, error = cpb.RUN_STATE_FAILED, str(exc)
            log.warning("run %s (workflow %s v%d) failed at node %s: %s", live.run.run_id,
                        graph.name, graph.version, exc.path, exc.reason)  # fmt: skip
        except TimeoutError:
            running = sorted(p for p, n in live.nodes.items() if n.state == cpb.RUN_STATE_RUNNING)
            state = cpb.RUN_STATE_FAILED
            error = f"deadline of {deadline_ms} ms exceeded; cancelled nodes: "
            error += ", ".join(running) or "none"
            log.warning("run %s (workflow %s v%d) failed: %s", live.run.run_id, graph.name,
                        graph.version, error)  # fmt: skip
        except asyncio.CancelledError:
            state, error = cpb.RUN_STATE_CANCELLED, live.cancel_reason or "cancelled"
        except Exception as exc:  # a bug: the run fails with it rather than hanging
            log.exception("run %s", live.run.run_id)
            state, error = cpb.RUN_STATE_FAILED, f"internal error: {exc!r}"
        self._release(executor.early)  # picks of nodes that never ran (a switch, a failure)
        for ns in live.nodes.values():
            if ns.state == cpb.RUN_STATE_RUNNING:
                ns.state, ns.finished_unix_ms = cpb.RUN_STATE_CANCELLED, now_ms()
        try:
            out_values = {k: from_python(v, f"output {k!r}") for k, v in outputs.items()}
        except InvalidArgument as exc:
            state, error, out_values = cpb.RUN_STATE_FAILED, str(exc), {}
        run = live.run
        run.state, run.error, run.finished_unix_ms = state, error, now_ms()  # type: ignore[assignment]
        for k, v in out_values.items():
            run.outputs[k].CopyFrom(v)
        finished = live.event(
            run_finished=cpb.RunFinished(state=state, outputs=out_values, error=error)  # type: ignore[arg-type]
        )
        try:
            # In Redis first, then visible: see the module docstring.
            await asyncio.shield(self._final_flush(live, finished))
        except Exception as exc:
            finished = self._unrecordable(live, exc)
            state, error = cpb.RUN_STATE_FAILED, finished.run_finished.error
        finally:
            if state != cpb.RUN_STATE_SUCCEEDED:
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            span.end()
            metrics.run_finished(state)
            live.publish(finished, at_once=True)
            self._untrack(live)

    def _unrecordable(self, live: LiveRun, exc: Exception) -> cpb.RunEvent:
        """The run's end when its record cannot be written: FAILED with an UNAVAILABLE
        reason (kept here and written once Redis answers), never a success nobody stored."""
        run = live.run
        was = cpb.RunState.Name(run.state).removeprefix("RUN_STATE_").lower()
        reason = (
            f"UNAVAILABLE: the run ended ({was}) but Redis did not take its record for "
            f"{self.record_retry_s:.0f} s ({type(exc).__name__}: {exc}); reported failed "
            "instead of finished unrecorded: submit it again"
        )
        log.error("run %s: %s", run.run_id, reason)
        run.state, run.error = cpb.RUN_STATE_FAILED, reason
        run.outputs.clear()
        finished = live.event(
            run_finished=cpb.RunFinished(state=cpb.RUN_STATE_FAILED, error=reason)
        )
        self.unrecorded[live.key] = (live, finished)
        return finished

    async def _final_flush(self, live: LiveRun, finished: cpb.RunEvent) -> None:
        if live.registered is not None:
            # Its entry must be in Redis before the final write removes it.
            with contextlib.suppress(Exception):
                await live.registered
        backoff = Backoff.within(self.record_retry_s, 0.05, 1.0)
        while True:
            try:
                await self._flush(live, finished)
                return
            except Exception as exc:
                delay = backoff.next()
                if delay is None:
                    raise
                log.warning("run %s: final write failed (%s); retrying", live.run.run_id, exc)
                await asyncio.sleep(delay)

    async def get(self, run_id: str, tenant: str = "") -> cpb.Run:
        """The record of ``tenant``'s run ``run_id`` (the tenant whose keys it is under)."""
        name = await run_keys.resolve(self, tenant, run_id)
        live = self.live.get(name) or self.unrecorded.get(name, (None,))[0]
        if live is not None:
            return live.record()
        data = await self.redis.get(run_key(name))
        if data is None:
            kept = f"finished runs are kept {self.run_ttl_s:.0f} s"
            raise NotFound(f"unknown run {run_id!r} ({kept})")
        run = cpb.Run()
        run.ParseFromString(data)
        return run

    async def events(
        self, run_id: str, from_seq: int = 0, tenant: str = ""
    ) -> AsyncIterator[cpb.RunEvent]:
        """Every event with ``seq >= from_seq``, then live ones until the run finishes."""
        name = await run_keys.resolve(self, tenant, run_id)
        live = self.live.get(name)
        if live is None and name in self.unrecorded:
            done, _ = self.unrecorded[name]
            for ev in done.events[max(from_seq - 1, 0) :]:  # RunFinished included
                yield ev
            return
        if live is None:
            async for ev in self._stored_events(name, from_seq):
                yield ev
            return
        index = max(from_seq - 1, 0)
        live.listeners += 1
        try:
            while True:
                while index < len(live.events):
                    ev = live.events[index]
                    index += 1
                    yield ev
                    if ev.HasField("run_finished"):
                        return
                live.changed.clear()
                if index < len(live.events):
                    continue
                await live.changed.wait()
        finally:
            live.listeners -= 1

    async def _stored_events(self, name: str, from_seq: int) -> AsyncIterator[cpb.RunEvent]:
        if not await run_keys.known(self.redis, name):
            raise NotFound(f"unknown run {run_keys.id_of(name)!r}")
        key = events_key(name)
        start = max(from_seq - 1, 0)
        if start and start >= await self.redis.llen(key):
            # The caller saw more than was recorded (its coordinator died before a flush,
            # then the run was adopted and ended): still give it the end of the run.
            last = await self.redis.lindex(key, -1)
            if last is not None:
                ev = cpb.RunEvent()
                ev.ParseFromString(last)
                if ev.HasField("run_finished"):
                    yield ev
            return
        while True:
            batch = await self.redis.lrange(key, start, start + 255)
            for raw in batch:
                ev = cpb.RunEvent()
                ev.ParseFromString(raw)
                yield ev
            if len(batch) < 256:
                return
            start += len(batch)

    async def cancel(self, run_id: str, reason: str = "", tenant: str = "") -> int:
        """Cancel a live run (its in-flight calls are cancelled); returns the state."""
        live = self.live.get(await run_keys.resolve(self, tenant, run_id))
        if live is None:
            return (await self.get(run_id, tenant)).state
        live.cancel_reason = f"cancelled: {reason}" if reason else "cancelled by the client"
        if live.task is not None:
            live.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(live.task)
        return cpb.RUN_STATE_CANCELLED
