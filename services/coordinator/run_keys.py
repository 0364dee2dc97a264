"""The run store's key layout in Redis: every key of a run carries its tenant. No gRPC.

A run is stored under its *name*, ``omniflow.security.tenancy.run_name(tenant, run_id)``
(``<len>:<tenant>/<id>``; the plain id for tenant ""):

- ``omniflow:run:{name}``: the ``Run`` record; ``omniflow:run:{name}:events`` its events;
  ``omniflow:run:{name}:resumed`` how often it was adopted and resumed.
- ``omniflow:runs:active``: hash name → id of the coordinator running it (``adoption``).

A key written for one tenant's run is therefore never a key of another tenant's run,
whatever ids the two choose. Upgrade: runs written before keys carried tenants sit under
their plain id; a tenant's lookup that finds nothing under its name reads the plain id
once the run's owner record (``omniflow:tenant:run:{id}``, checked first) says the run is
the tenant's, and such a run still active is adopted and resumed under its plain name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from omniflow.security.tenancy import run_name

if TYPE_CHECKING:
    from omniflow_services.coordinator.runs import RunManager

ACTIVE_KEY = "omniflow:runs:active"

__all__ = [
    "ACTIVE_KEY", "events_key", "id_of", "known", "resolve", "run_key", "run_name", "tenant_of",
]  # fmt: skip


def run_key(name: str) -> str:
    return f"omniflow:run:{name}"


def events_key(name: str) -> str:
    return f"{run_key(name)}:events"


def id_of(name: str) -> str:
    """The run id a client knows, from a run's name."""
    return name.rsplit("/", 1)[-1]


def tenant_of(name: str) -> str:
    """The tenant whose run ``name`` is ("" for a plain id: tenant "" or the old layout)."""
    size, sep, rest = name.partition(":")
    if not sep or not size.isdigit() or rest[int(size) : int(size) + 1] != "/":
        return ""
    return rest[: int(size)]


async def known(redis: aioredis.Redis, name: str) -> bool:
    """Whether Redis knows the run: its record, or its active entry (a run whose
    coordinator died before its first flush)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.exists(run_key(name))
        pipe.hexists(ACTIVE_KEY, name)
        record, active = await pipe.execute()
    return bool(record or active)


async def resolve(m: RunManager, tenant: str, run_id: str) -> str:
    """The name of ``tenant``'s run ``run_id`` (whose owner record the caller checked):
    under the tenant's namespace, or the plain id of a run stored before keys carried
    tenants."""
    name = run_name(tenant, run_id)
    if not tenant or name in m.live or name in m.unrecorded or await known(m.redis, name):
        return name
    if run_id in m.live or run_id in m.unrecorded or await known(m.redis, run_id):
        return run_id  # the previous layout
    return name
