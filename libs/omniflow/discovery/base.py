"""Service discovery interface shared by every backend.

A service instance registers itself once it is ready to serve and keeps the
registration alive for as long as it runs. Liveness follows two paths:

* graceful stop (SIGTERM): the service calls ``deregister`` explicitly, and
  watchers see the instance vanish at once;
* hard death (SIGKILL, a crash, a lost node): nobody deregisters, the
  registration's TTL (or its failing health check) expires, and watchers see
  the instance vanish within about one TTL.

``Registry.close`` therefore only stops the background refreshers and releases
connections; it never deregisters, so that a process that closes its registry
without deregistering looks exactly like one that died.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar

from omniflow.errors import InvalidArgument, OmniflowError, Unavailable

log = logging.getLogger(__name__)

_R = TypeVar("_R")

# Names end up in Redis keys, Consul ids and file keys: keep them to a safe alphabet
# (no ':' so that a Redis key splits unambiguously, no '/' for Consul's URL paths).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")


class DiscoveryError(Unavailable):
    """The discovery backend failed, could not be reached, or was misconfigured."""


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid service name or instance id, else raise."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise InvalidArgument(
            f"bad {kind} {value!r}: expected 1-128 characters of [A-Za-z0-9_.@-], "
            "starting with a letter or digit"
        )
    return value


def split_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into host and port, validating both."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise InvalidArgument(f"bad address {address!r}: expected 'host:port' with port 1-65535")
    return host.removeprefix("[").removesuffix("]"), int(port_s)


@dataclass(frozen=True, slots=True)
class ServiceInstance:
    """One running instance of a service, as stored in and returned by a registry.

    ``metadata`` carries string pairs such as role, model, kv_namespace, node and
    metrics address. It takes no part in the hash (a dict is not hashable) but does
    in equality; treat it as read-only.
    """

    service: str
    instance_id: str
    address: str
    metadata: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_name("service name", self.service)
        check_name("instance id", self.instance_id)
        split_address(self.address)
        if not isinstance(self.metadata, Mapping):
            raise InvalidArgument(f"metadata of {self.instance_id!r} must be a mapping")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidArgument(
                    f"metadata of {self.instance_id!r} must map str to str, got {key!r}: {value!r}"
                )
        # A private copy: the caller's dict may change later, this instance must not.
        object.__setattr__(self, "metadata", dict(self.metadata))

    @property
    def host(self) -> str:
        return split_address(self.address)[0]

    @property
    def port(self) -> int:
        return split_address(self.address)[1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, the inverse of :meth:`from_dict`."""
        return {
            "service": self.service,
            "instance_id": self.instance_id,
            "address": self.address,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServiceInstance:
        try:
            return cls(
                service=data["service"],
                instance_id=data["instance_id"],
                address=data["address"],
                metadata=dict(data.get("metadata") or {}),
            )
        except (KeyError, TypeError) as exc:
            raise InvalidArgument(f"bad service instance record {data!r}: {exc}") from exc


def sorted_instances(instances: list[ServiceInstance]) -> list[ServiceInstance]:
    """Canonical order (by instance id), so that two listings compare equal."""
    return sorted(instances, key=lambda inst: inst.instance_id)


class KeepAlive:
    """The registrations a TTL backend keeps alive: each instance with its TTL, and the
    background task that refreshes it (a ``TTLRegistry``'s ``_alive``)."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self.registered: dict[str, tuple[ServiceInstance, float]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise DiscoveryError(f"{self._backend} discovery registry is closed")

    def begin(self, instance: ServiceInstance, ttl_s: float) -> None:
        """Before a (re-)registration: the registry is open, the TTL positive, and the
        instance's old refresher stopped."""
        self.check_open()
        if not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s!r}")
        self.stop(instance.instance_id)

    def keep(
        self, instance: ServiceInstance, ttl_s: float, refresh: Coroutine[Any, Any, None] | None
    ) -> None:
        """Remember a registration and run its refresher (when the backend needs one)."""
        iid = instance.instance_id
        self.registered[iid] = (instance, ttl_s)
        if refresh is not None:
            self._tasks[iid] = asyncio.create_task(refresh, name=f"discovery-refresh-{iid}")

    def stop(self, instance_id: str) -> None:
        task = self._tasks.pop(instance_id, None)
        if task is not None:
            task.cancel()

    def forget(self, instance_id: str) -> tuple[ServiceInstance, float] | None:
        """Stop refreshing ``instance_id``; its registration as it was, if this process made it."""
        self.stop(instance_id)
        return self.registered.pop(instance_id, None)

    async def close(self) -> bool:
        """Cancel every refresher and wait for them; False when closed already."""
        if self.closed:
            return False
        self.closed = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return True


class Registry(abc.ABC):
    """An async service registry.

    Every network call a backend makes has a timeout; failures surface as
    :class:`DiscoveryError`. Usable as an async context manager (``close`` on exit).
    """

    @abc.abstractmethod
    async def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        """Register ``instance`` and keep it alive until ``deregister`` or ``close``.

        Backends that need it refresh the registration in a background task every
        ``ttl_s / 3``; if this process dies, the registration lapses after ``ttl_s``.
        Registering an instance id again replaces the earlier registration.
        """

    @abc.abstractmethod
    async def deregister(self, instance_id: str) -> None:
        """Remove the registration now (graceful shutdown). Unknown ids are ignored."""

    @abc.abstractmethod
    async def list(self, service: str) -> list[ServiceInstance]:
        """Live (healthy) instances of ``service``, ordered by instance id."""

    @abc.abstractmethod
    def watch(self, service: str) -> AsyncIterator[list[ServiceInstance]]:
        """Yield the current live instances at once, then again after every change.

        Transient backend failures are logged and retried; the iterator keeps
        going. Close it (``contextlib.aclosing``) or ``close`` the registry to stop.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop refreshers and watches and release connections. Does not deregister."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class TTLRegistry(Registry):
    """A registry whose registrations lapse unless kept alive (the Redis and Consul
    backends): their keep-alive state, the checks each call starts with, and the reading
    of the records the backend lists."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._alive = KeepAlive(backend)

    def _opened(self, kind: str, name: str) -> str:
        """``name``, once the registry is known to be open and ``name`` a valid ``kind``."""
        self._alive.check_open()
        return check_name(kind, name)

    def _instances(
        self, service: str, records: Iterable[_R], parse: Callable[[_R], ServiceInstance]
    ) -> list[ServiceInstance]:
        """What ``parse`` makes of each record, in canonical order. A record that does not
        parse (another tool writing our keys, an odd agent entry) is logged and skipped: one
        bad record must not hide the rest."""
        out = []
        for record in records:
            try:
                out.append(parse(record))
            except (KeyError, TypeError, ValueError, OmniflowError) as exc:
                log.warning(
                    "%s discovery: skipping a bad record of service %s: %s",
                    self._backend,
                    service,
                    exc,
                )
        return sorted_instances(out)
