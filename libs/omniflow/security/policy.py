"""The one policy table: which caller may call which RPC (docs/security.md).

Each method has a :class:`Rule`: the service kinds (from certificates) and token roles
allowed to call it. ``node_local`` narrows the service kinds to the server's own node
(a kv-agent's pages belong to its node's workers). Checks that depend on the request —
a lease's owner, a run's tenant — are made by the handler with the helpers at the end,
on the caller the wrapper put in :func:`current`.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from omniflow.errors import NotFound, PermissionDenied
from omniflow.security.identity import (
    SERVICE_KINDS,
    UNCHECKED,
    Identity,
    Principal,
    forwarded,
)


@dataclass(frozen=True, slots=True)
class Rule:
    """Who may call one method.

    ``kinds``: service identities allowed (any token or none). ``local_kinds``: service
    identities allowed only from the server's own node. ``roles``: token roles allowed
    (from any certificate). ``anyone``: any authenticated peer (health checks).
    """

    kinds: frozenset[str] = frozenset()
    roles: frozenset[str] = frozenset()
    local_kinds: frozenset[str] = frozenset()
    anyone: bool = False

    def allows(self, who: Principal, own: Identity | None) -> bool:
        if self.anyone or not who.enforced:
            return True
        if who.roles & self.roles:
            return True
        ident = who.identity
        if ident is None:
            return False
        if ident.kind in self.kinds:
            return True
        return ident.kind in self.local_kinds and own is not None and ident.node == own.node


def _rule(
    kinds: tuple[str, ...] = (), roles: tuple[str, ...] = ("admin",), local: tuple[str, ...] = ()
) -> Rule:
    return Rule(frozenset(kinds), frozenset(roles), frozenset(local))


ANYONE = Rule(anyone=True)
ADMIN = _rule()
#: Tenants (user tokens, or a forwarder naming one) and every service.
CALLERS = _rule(SERVICE_KINDS, ("admin", "user"))
SERVICES = _rule(SERVICE_KINDS)
#: Index owners; the handler also checks that the owner id is the caller's own.
OWNERS = _rule(("worker", "kv-agent"), ("admin",))
#: A kv-agent's pages belong to its node's workers.
NODE_WORKERS = _rule(local=("worker",))
#: Pages leave a node only agent to agent (pulls).
PAGE_READERS = _rule(("kv-agent",), local=("worker",))
#: A NIXL pull's grant, asked over mutual TLS by the pulling agent: the arena's address, the
#: pinned slots and their release; the UCX READ that follows authenticates nobody itself.
NIXL_GRANT = PAGE_READERS

_KVINDEX = "omniflow.api.kvindex.v1.KVIndexService"
_KVAGENT = "omniflow.api.kvagent.v1.KVAgentService"
_ROUTER = "omniflow.api.router.v1.RouterService"
_WORKER = "omniflow.api.worker.v1.WorkerService"
_COORD = "omniflow.api.coordinator.v1.CoordinatorService"

_COORD_METHODS = (
    *("RegisterWorkflow", "ListWorkflows", "GetWorkflow", "SubmitRun", "RunWorkflow"),
    *("StreamRunEvents", "GetRun", "CancelRun", "GetCluster"),
)

_TABLE: dict[str, dict[str, Rule]] = {
    _KVINDEX: {
        "RegisterNamespace": OWNERS,
        "AcquireLease": OWNERS,
        "Heartbeat": OWNERS,
        "ReleaseLease": OWNERS,
        "PublishEvents": OWNERS,
        "Snapshot": OWNERS,
        # Cache probing is for the services that route and fetch, never for tenants.
        "MatchPrefix": SERVICES,
        "Stats": SERVICES,
        "GetNamespace": SERVICES,
    },
    _KVAGENT: {
        "GetArena": NIXL_GRANT,
        "PutPages": NODE_WORKERS,
        # Other agents pull pages across nodes; workers read their own node's.
        "GetPages": PAGE_READERS,
        "LocatePages": NIXL_GRANT,
        "CommitPages": NODE_WORKERS,
        "Unpin": NIXL_GRANT,
        "PullPages": NODE_WORKERS,
        "FetchPages": NODE_WORKERS,
        "Evict": NODE_WORKERS,
        "Stats": SERVICES,
        "PutTensor": _rule(("worker", "coordinator", "gateway")),
        "GetTensor": _rule(("worker", "kv-agent", "coordinator", "gateway")),
        "DeleteTensor": _rule(("worker", "coordinator", "gateway")),
        "GetTransport": PAGE_READERS,
    },
    _ROUTER: {
        "Pick": _rule(("coordinator", "gateway", "router")),
        # Outcomes open and close circuit breakers: only the router's own clients.
        "ReportOutcome": _rule(("coordinator", "gateway")),
        "ReportOutcomes": _rule(("coordinator", "gateway")),
        "ListWorkers": CALLERS,
        "GetStats": CALLERS,
    },
    # Served by workers and by the router's proxy: the proxy is itself checked here, and
    # the worker believes a LoadModel only from an admin or a router (which checked it).
    _WORKER: {
        "Generate": CALLERS,
        "Encode": CALLERS,
        "GenerateImage": CALLERS,
        "Synthesize": CALLERS,
        "Invoke": CALLERS,
        "Abort": CALLERS,
        "GetLoad": CALLERS,
        "GetInfo": CALLERS,
        "LoadModel": _rule(("router",)),
    },
    _COORD: {
        name: CALLERS
        for name in (
            "RegisterWorkflow",
            "ListWorkflows",
            "GetWorkflow",
            "SubmitRun",
            "RunWorkflow",
            "StreamRunEvents",
            "GetRun",
            "CancelRun",
            "GetCluster",
        )
    },
    "grpc.health.v1.Health": {"Check": ANYONE, "Watch": ANYONE},
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo": ANYONE},
    "grpc.reflection.v1.ServerReflection": {"ServerReflectionInfo": ANYONE},
}


def rule_for(method: str) -> Rule:
    """The rule of ``/package.Service/Method``; methods not in the table are admin-only."""
    service, _, name = method.lstrip("/").partition("/")
    return _TABLE.get(service, {}).get(name, ADMIN)


def table() -> dict[str, dict[str, Rule]]:
    """The policy table (for docs and tests)."""
    return {s: dict(m) for s, m in _TABLE.items()}


# -- the caller of the RPC being served, for request-dependent checks in handlers

_CALLER: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "omniflow_principal", default=UNCHECKED
)


def current() -> Principal:
    """The caller of the RPC being served (UNCHECKED outside a handler or with auth off)."""
    return _CALLER.get()


def set_current(who: Principal) -> contextvars.Token[Principal]:
    return _CALLER.set(who)


def reset_current(token: contextvars.Token[Principal]) -> None:
    _CALLER.reset(token)


def require_owner(owner_id: str, node: str | None = None, what: str = "owner_id") -> None:
    """Only the owner itself (its certificate's instance id, on its certificate's node) or
    an admin acts as ``owner_id``: nobody takes over another owner's lease or entries."""
    who = current()
    if who.is_admin:
        return
    if who.identity is None or who.identity.instance != owner_id:
        raise PermissionDenied(
            f"{what} {owner_id!r} is not the caller's own identity ({who.describe()})"
        )
    if node is not None and node != who.identity.node:
        raise PermissionDenied(f"node {node!r} is not the caller's node ({who.describe()})")


def caller_tenant() -> str:
    """The tenant the current call acts for ("" with auth off or for a service itself)."""
    return current().tenant


def require_tenant(owner_tenant: str, what: str) -> None:
    """A resource of another tenant is invisible: NotFound, not a hint that it exists."""
    who = current()
    if who.enforced and owner_tenant != who.tenant and "admin" not in who.roles:
        raise NotFound(f"{what} not found")


def require_may_change(owner_tenant: str | None, what: str) -> None:
    """Changing a tenant's resource: its own tenant or an admin (a free name is anyone's)."""
    who = current()
    if owner_tenant is None or who.is_admin or owner_tenant == who.tenant:
        return
    raise PermissionDenied(f"{what} belongs to another tenant; only it or an admin may change it")


def forwarding_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata naming the tenant of the call being served, sent with every call made
    while serving it (a coordinator's node calls, the gateway's Pick and Generate): the
    next service then checks and keys the call as that tenant's. Believed only from a
    gateway, coordinator or router certificate (``identity.FORWARDERS``)."""
    tenant = _CALLER.get().tenant
    return forwarded(tenant) if tenant else ()
