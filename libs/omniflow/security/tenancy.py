"""Which tenant owns a run or a workflow (Redis), and the checks the coordinator makes.

- ``omniflow:tenant:run:{run_id}`` → tenant, set once (``SET NX``) when the run is
  submitted; another tenant's run is NOT_FOUND for GetRun, StreamRunEvents, CancelRun.
  The run's own keys carry its tenant too (``run_name``), so no key one tenant writes
  can be read as, or break, a key of another tenant's run.
- ``omniflow:tenant:workflow:{name}`` → tenant of the first registration; only that
  tenant or an admin registers new versions. A workflow with no owner, or one owned by
  the tenant "" (registered by an admin for everyone), is visible to every tenant.

With auth off (the caller is not ``enforced``) nothing is read or written.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import redis.asyncio as aioredis

from omniflow.errors import NotFound, PermissionDenied
from omniflow.security import policy

RUN_KEY = "omniflow:tenant:run:{}"
WORKFLOW_KEY = "omniflow:tenant:workflow:{}"
#: Ownership of a run outlives its record (kept for the coordinator's run TTL).
RUN_OWNER_TTL_S = 7 * 24 * 3600


def scoped_id(request_id: str) -> str:
    """``request_id`` as the caller's own: prefixed with the length and name of the caller's
    tenant, so that the same id sent by two tenants names two requests, and no id one
    tenant can send names another's (an Abort of another tenant's request finds nothing).
    With auth off every caller is the one tenant ""."""
    tenant = policy.current().tenant
    return f"{len(tenant)}:{tenant}/{request_id}"


def run_name(tenant: str, run_id: str) -> str:
    """The name a run's Redis keys carry: its id in its tenant's namespace (the tenant's
    length and name first, as ``scoped_id``; run ids hold no ``:`` or ``/``, so no name of
    one tenant is, or starts, a name of another). Tenant "" (admins, services, auth off)
    keeps the plain id: the layout every run had before keys carried tenants."""
    return f"{len(tenant)}:{tenant}/{run_id}" if tenant else run_id


def _text(raw: bytes | str | None) -> str | None:
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else raw


class Tenancy:
    """Ownership records of runs and workflows in the coordinator's Redis."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def claim_run(self, run_id: str) -> str:
        """The run id to submit under the caller's tenant (a fresh one when ``run_id`` is
        empty); PermissionDenied when another tenant already holds that id."""
        who = policy.current()
        if not who.enforced:
            return run_id
        run_id = run_id or uuid.uuid4().hex
        key = RUN_KEY.format(run_id)
        if await self.redis.set(key, who.tenant, nx=True, ex=RUN_OWNER_TTL_S):
            return run_id
        if _text(await self.redis.get(key)) != who.tenant:
            raise PermissionDenied(f"run id {run_id!r} is taken; submit without a run id")
        return run_id  # the same tenant resubmitting (failover): idempotent

    async def check_run(self, run_id: str) -> str:
        """The tenant whose run ``run_id`` is (its keys' namespace): NotFound unless it is
        the caller's own; an admin reaches any tenant's run ("" with auth off)."""
        who = policy.current()
        if not who.enforced:
            return ""
        owner = _text(await self.redis.get(RUN_KEY.format(run_id)))
        if "admin" in who.roles:
            return owner or ""
        if owner is None or owner != who.tenant:
            raise NotFound(f"run {run_id!r} not found")
        return owner

    async def _workflow_owner(self, name: str) -> str | None:
        return _text(await self.redis.get(WORKFLOW_KEY.format(name)))

    async def claim_workflow(self, name: str) -> None:
        """Before registering a version of ``name``: the caller's tenant owns it, or it is
        free (then it becomes the caller's). PermissionDenied for another tenant's."""
        who = policy.current()
        if not who.enforced:
            return
        key = WORKFLOW_KEY.format(name)
        if await self.redis.set(key, who.tenant, nx=True):
            return
        policy.require_may_change(await self._workflow_owner(name), f"workflow {name!r}")

    async def check_workflow(self, name: str) -> None:
        """NotFound for a workflow of another tenant."""
        who = policy.current()
        if not who.enforced or "admin" in who.roles:
            return
        owner = await self._workflow_owner(name)
        if owner not in (None, "", who.tenant):
            raise NotFound(f"workflow {name!r} not found")

    async def visible(self, names: Iterable[str]) -> set[str]:
        """The workflows of ``names`` the caller may see."""
        names = list(names)
        who = policy.current()
        if not who.enforced or "admin" in who.roles or not names:
            return set(names)
        owners = await self.redis.mget([WORKFLOW_KEY.format(n) for n in names])
        return {n for n, o in zip(names, owners, strict=True) if _text(o) in (None, "", who.tenant)}
