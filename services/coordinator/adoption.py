"""Adoption of orphaned runs: a coordinator claims the active runs of one that died and
resumes (once) or fails them; see the ``runs`` module docstring. No gRPC here.

A resumed run first waits (up to ``RunManager.adopt_wait_s``) until every role its graph
calls is served by a healthy worker: after ``omniflow up`` on a run folder whose processes
all died, the coordinator starts before the workers, and a run resumed at once would fail
on its first call."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from omniflow import telemetry
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.backoff import Backoff
from omniflow.errors import OmniflowError
from omniflow.security import policy
from omniflow.security.identity import Principal
from omniflow_services.coordinator import metrics
from omniflow_services.coordinator.limits import call_roles
from omniflow_services.coordinator.live import LiveRun, now_ms
from omniflow_services.coordinator.run_keys import (
    ACTIVE_KEY,
    events_key,
    id_of,
    run_key,
    tenant_of,
)

if TYPE_CHECKING:
    from omniflow_services.coordinator.runs import RunManager

log = logging.getLogger(__name__)

TERMINAL = (cpb.RUN_STATE_SUCCEEDED, cpb.RUN_STATE_FAILED, cpb.RUN_STATE_CANCELLED)
MAX_RESUMES = 1  # a run that kills its coordinators is not run a third time

# Claim an orphaned run: only if the entry still names the dead owner and (unless it is
# the claimant itself, restarted) that owner's lease is still missing.
# KEYS: active set, the owner's lease. ARGV: run name (``run_keys``), owner, claimant.
CLAIM = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[2] ~= ARGV[3] and redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


def lease_key(owner: str) -> str:
    return f"omniflow:coordinator:{owner}:lease"


async def recover(m: RunManager, confirm: bool = False) -> int:
    """Adopt the active runs whose coordinator is gone (resume or fail each); returns
    how many.

    With ``confirm`` (the periodic sweep) a run of another coordinator is adopted only
    when its lease was missing on the previous sweep too, so that a coordinator that
    lost Redis for a moment has renewed its lease before anyone takes its runs."""
    active = await m.redis.hgetall(ACTIVE_KEY)
    failed = resumed = 0
    suspects: set[tuple[str, str]] = set()
    for raw_name, raw_owner in active.items():
        name, owner = raw_name.decode(), raw_owner.decode()  # a run's name: see run_keys
        if name in m.live or name in m.unrecorded:
            continue
        if owner != m.owner_id:
            if await m.redis.exists(lease_key(owner)):
                continue
            if confirm and (name, owner) not in m.suspects:
                suspects.add((name, owner))
                continue
        if not await m.claim(keys=[ACTIVE_KEY, lease_key(owner)], args=[name, owner, m.owner_id]):
            continue  # another coordinator adopted it, or its owner came back
        if await _resume(m, name, owner):
            resumed += 1
            continue
        await _fail(m, name, owner)
        failed += 1
    m.suspects = suspects
    if failed or resumed:
        log.warning("adopted interrupted runs: %d resumed, %d marked failed", resumed, failed)
    return failed + resumed


async def _resume(m: RunManager, name: str, owner: str) -> bool:
    """Run an adopted run again from its recorded inputs under the same id; False
    when it cannot be (the caller then fails it)."""
    if not m.resume_orphans or len(m.live) >= m.max_runs:
        return False
    run_id = id_of(name)
    key = run_key(name)
    data = await m.redis.get(key)
    if data is None:
        return False  # never flushed: its inputs are not recorded
    run = cpb.Run()
    run.ParseFromString(data)
    if run.state in TERMINAL:
        return False
    async with m.redis.pipeline(transaction=True) as pipe:
        pipe.incr(f"{key}:resumed")
        pipe.expire(f"{key}:resumed", int(m.run_ttl_s))
        resumes, _ = await pipe.execute()
    if int(resumes) > MAX_RESUMES:
        return False
    try:
        graph = await m.catalogue.get(run.workflow, run.version)
        values = m._check_inputs(graph, run.inputs)
    except OmniflowError as exc:
        log.warning("run %s cannot be resumed: %s", run_id, exc)
        return False
    stored = await m.redis.lrange(f"{key}:events", 0, -1)
    del run.nodes[:]
    live = LiveRun(run)
    for raw in stored:
        ev = cpb.RunEvent()
        ev.ParseFromString(raw)
        live.events.append(ev)
    live.flushed = len(live.events)
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    live.registered = done  # the claim is its active entry
    live.key = name
    m.live[name] = live
    metrics.run_started()
    span = telemetry.tracer().start_span(f"run {graph.name} (resumed)")
    span.set_attribute("omniflow.run_id", run_id)
    log.warning("run %s of coordinator %s: resumed from its inputs", run_id, owner)
    # The run's calls act for its tenant again (salted KV hints, forwarded tenant, scoped
    # ids), as they did on the coordinator that died: its name says whose it is.
    tenant = tenant_of(name)
    who = policy.set_current(Principal(None, tenant, frozenset({"user"}))) if tenant else None
    try:
        with trace.use_span(span, end_on_exit=False):
            live.task = asyncio.create_task(_when_served(m, live, graph, values, span))
    finally:
        if who is not None:
            policy.reset_current(who)
    return True


async def _when_served(
    m: RunManager, live: LiveRun, graph: cpb.WorkflowGraph, values: dict[str, Any], span: Any
) -> None:
    """Execute an adopted run once the roles it calls are served (or the wait is over: then
    it runs anyway, and its calls fail over or fail with their own reasons)."""
    needed = call_roles(list(graph.nodes))
    backoff = Backoff.within(m.adopt_wait_s, 0.2, 2.0)
    while m.roles_served is not None and needed:
        try:
            missing = needed - await m.roles_served()
        except OmniflowError as exc:
            missing = {f"(no answer: {exc})"}
        if not missing:
            break
        delay = backoff.next()
        if delay is None:
            log.warning("run %s: resumed although %s not served after %.0f s", live.run.run_id,
                        ", ".join(sorted(missing)), m.adopt_wait_s)  # fmt: skip
            break
        await asyncio.sleep(delay)
    await m._execute(live, graph, values, graph.default_deadline_ms, span, {})


async def _fail(m: RunManager, name: str, owner: str) -> None:
    run_id = id_of(name)
    data = await m.redis.get(run_key(name))
    run = cpb.Run()
    if data is not None:
        run.ParseFromString(data)
    if run.state not in TERMINAL:
        reason = f"interrupted: coordinator {owner} restarted or died while the run was in progress"
        run.state, run.error, run.finished_unix_ms = cpb.RUN_STATE_FAILED, reason, now_ms()
        seq = await m.redis.llen(events_key(name))
        ev = cpb.RunEvent(run_id=run_id, seq=seq + 1, unix_ms=now_ms())
        ev.run_finished.state, ev.run_finished.error = cpb.RUN_STATE_FAILED, reason
        async with m.redis.pipeline(transaction=True) as pipe:
            pipe.set(run_key(name), run.SerializeToString(), ex=int(m.run_ttl_s))
            pipe.rpush(events_key(name), ev.SerializeToString())
            pipe.expire(events_key(name), int(m.run_ttl_s))
            await pipe.execute()
    await m.redis.hdel(ACTIVE_KEY, name)
