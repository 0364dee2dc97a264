"""Consul discovery backend, through py-consul's synchronous client.

py-consul's asyncio client needs aiohttp, which Omni-Flow does not depend on,
so every call runs the ``requests``-based client in a worker thread
bounded by the client's own timeout and an asyncio one. Watches hold a thread
each for the length of a blocking query, so they get a pool of their own and
cannot starve the event loop's default executor.

Each instance becomes a Consul service registration on the local agent:
``ID`` = instance id, ``Name`` = service, ``Address``/``Port`` from the
instance address, ``Meta`` = the instance metadata. One health check is
attached, selected by ``check``:

* ``"ttl"`` (default): a TTL check that this process marks passing every
  ttl/3 (``PUT /v1/agent/check/pass/<id>``). If the process dies, the check
  goes critical after the TTL and the instance leaves the passing list.
* ``"grpc"``: Consul itself calls the instance's standard gRPC health service
  every ``grpc_interval_s`` (``GRPCUseTLS`` false); nothing to refresh here.

Both carry ``DeregisterCriticalServiceAfter`` so that Consul reaps instances
that stay critical (Consul's minimum is one minute). Listing and watching read
``/v1/health/service/<name>?passing``; watching uses blocking queries
(``index`` + ``wait``). The ACL token comes from ``token`` or CONSUL_HTTP_TOKEN,
the agent address from ``address`` or CONSUL_HTTP_ADDR.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import consul
import requests

from omniflow.backoff import Backoff
from omniflow.config import CommonSettings, load_settings
from omniflow.discovery.base import DiscoveryError, ServiceInstance, TTLRegistry
from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

T = TypeVar("T")
CheckKind = Literal["ttl", "grpc"]


def _parse_agent_address(address: str) -> tuple[str, str, int]:
    """``host:port`` or ``http(s)://host:port`` -> (scheme, host, port)."""
    parts = urlsplit(address if "//" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"bad consul address {address!r}: {exc}") from exc
    if not parts.hostname or parts.scheme not in ("", "http", "https"):
        raise InvalidArgument(
            f"bad consul address {address!r}: expected host:port or http(s)://host:port"
        )
    return parts.scheme or "http", parts.hostname, port or 8500


def _go_duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _to_instance(entry: dict[str, Any]) -> ServiceInstance:
    svc = entry["Service"]
    host = svc.get("Address") or (entry.get("Node") or {}).get("Address", "")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return ServiceInstance(
        service=svc["Service"],
        instance_id=svc["ID"],
        address=f"{host}:{svc['Port']}",
        metadata=dict(svc.get("Meta") or {}),
    )


class ConsulRegistry(TTLRegistry):
    """Registry on a Consul agent (see the module docstring)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        check: CheckKind = "ttl",
        grpc_interval_s: float = 5.0,
        grpc_service: str | None = None,
        deregister_critical_after_s: float | None = 60.0,
        datacenter: str | None = None,
        timeout_s: float = 5.0,
        watch_wait_s: float = 30.0,
        verify: bool | str = True,
    ) -> None:
        if check not in ("ttl", "grpc"):
            raise InvalidArgument(f"bad consul check kind {check!r}: accepted 'ttl', 'grpc'")
        if timeout_s <= 0 or watch_wait_s <= 0 or grpc_interval_s <= 0:
            raise InvalidArgument("timeout_s, watch_wait_s and grpc_interval_s must be > 0")
        super().__init__("consul")
        common = load_settings(CommonSettings)
        address = address or common.consul_addr or "127.0.0.1:8500"
        scheme, host, port = _parse_agent_address(address)
        self._address = address
        # An explicit token wins; py-consul itself would prefer the environment's.
        self._token = token or common.consul_token or None
        self._check = check
        self._grpc_interval_s = grpc_interval_s
        self._grpc_service = grpc_service
        self._reap_after_s = deregister_critical_after_s
        self._timeout_s = timeout_s
        self._watch_wait_s = watch_wait_s
        # The one client for calls, and one more per watch (a blocking query holds its own).
        self._new_client: Callable[[], consul.Consul] = functools.partial(
            consul.Consul,
            host=host,
            port=port,
            scheme=scheme,
            token=self._token,
            dc=datacenter,
            verify=verify,
            connections_timeout=timeout_s,
        )
        self._client = self._new_client()
        # requests.Session is not documented thread-safe: one call at a time per client.
        self._client_lock = threading.Lock()
        # Blocking queries park a thread for up to watch_wait_s each.
        self._watch_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="consul-watch")

    async def _call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        lock: threading.Lock | None = None,
        extra_s: float = 0.0,
        pool: ThreadPoolExecutor | None = None,
    ) -> T:
        """Run a blocking py-consul call in a thread, with a timeout and error mapping."""
        lock = lock or self._client_lock

        def locked() -> T:
            with lock:
                return fn()

        try:
            # The client's own timeout ends the thread; this bound only adds slack.
            async with asyncio.timeout(self._timeout_s * 2 + extra_s + 1.0):
                return await asyncio.get_running_loop().run_in_executor(pool, locked)
        except consul.ACLPermissionDenied as exc:
            raise DiscoveryError(
                f"consul at {self._address}: {what}: ACL token rejected "
                "(set token= or CONSUL_HTTP_TOKEN to a token with service:write/read)"
            ) from exc
        except (consul.ConsulException, requests.RequestException, OSError, TimeoutError) as exc:
            raise DiscoveryError(
                f"consul at {self._address}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _check_id(self, instance_id: str) -> str:
        return f"omniflow:{instance_id}"

    def _check_definition(self, instance: ServiceInstance, ttl_s: float) -> dict[str, Any]:
        check: dict[str, Any] = {
            "CheckID": self._check_id(instance.instance_id),
            "Name": f"omniflow {self._check} check of {instance.instance_id}",
        }
        if self._check == "ttl":
            # Passing from the start: registration happens once the service is ready.
            check.update(TTL=_go_duration(ttl_s), Status="passing")
        else:
            target = instance.address
            if self._grpc_service:
                target = f"{target}/{self._grpc_service}"
            check.update(
                GRPC=target,
                GRPCUseTLS=False,
                Interval=_go_duration(self._grpc_interval_s),
                Timeout=_go_duration(min(self._grpc_interval_s, self._timeout_s)),
            )
        if self._reap_after_s is not None:
            check["DeregisterCriticalServiceAfter"] = _go_duration(self._reap_after_s)
        return check

    async def _register_once(self, instance: ServiceInstance, ttl_s: float) -> None:
        host, port = instance.host, instance.port
        check = self._check_definition(instance, ttl_s)

        def call() -> bool:
            return bool(
                self._client.agent.service.register(
                    instance.service,
                    service_id=instance.instance_id,
                    address=host,
                    port=port,
                    meta=dict(instance.metadata) or None,
                    check=check,
                    token=self._token,
                    replace_existing_checks=True,
                )
            )

        ok = await self._call(f"register {instance.service}/{instance.instance_id}", call)
        if not ok:
            raise DiscoveryError(
                f"consul at {self._address}: register {instance.instance_id} was refused"
            )

    async def _refresh_loop(self, instance: ServiceInstance, ttl_s: float) -> None:
        check_id = self._check_id(instance.instance_id)
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                try:
                    passed = await self._call(
                        f"pass check {check_id}",
                        lambda: self._client.agent.check.ttl_pass(check_id, token=self._token),
                    )
                except DiscoveryError as exc:
                    cause = exc.__cause__
                    # The agent answered with an error (older agents say 500 for an unknown
                    # check): try registering again. Anything else: just retry later.
                    if not isinstance(cause, consul.ConsulException) or isinstance(
                        cause, consul.ACLPermissionDenied | consul.Timeout
                    ):
                        raise
                    passed = False
                if not passed:
                    # The agent forgot us (restart, or reaped while we were stalled).
                    log.warning("consul lost check %s; registering again", check_id)
                    await self._register_once(instance, ttl_s)
            except DiscoveryError as exc:
                log.warning("refresh of %s failed: %s", instance.instance_id, exc)

    async def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        self._alive.begin(instance, ttl_s)
        await self._register_once(instance, ttl_s)
        # A gRPC check is the agent's to make; a TTL check is ours to keep passing.
        refresh = self._refresh_loop(instance, ttl_s) if self._check == "ttl" else None
        self._alive.keep(instance, ttl_s, refresh)

    async def deregister(self, instance_id: str) -> None:
        self._opened("instance id", instance_id)
        self._alive.forget(instance_id)
        # A 404 (unknown id) comes back as False: nothing to remove, which is fine.
        await self._call(
            f"deregister {instance_id}",
            lambda: self._client.agent.service.deregister(instance_id, token=self._token),
        )

    def _health(
        self, client: consul.Consul, service: str, index: str | None, wait_s: float | None
    ) -> tuple[str, list[ServiceInstance]]:
        index_out, entries = client.health.service(
            service,
            passing=True,
            index=index,
            wait=_go_duration(wait_s) if wait_s else None,
            token=self._token,
        )
        return str(index_out), self._instances(service, entries or [], _to_instance)

    async def list(self, service: str) -> list[ServiceInstance]:
        self._opened("service name", service)
        _, instances = await self._call(
            f"list {service}", lambda: self._health(self._client, service, None, None)
        )
        return instances

    async def watch(self, service: str) -> AsyncIterator[list[ServiceInstance]]:
        self._opened("service name", service)
        # A blocking query holds its connection for up to watch_wait_s: own client and lock.
        client, lock = self._new_client(), threading.Lock()
        wait_s = self._watch_wait_s
        index, last = await self._call(
            f"watch {service}",
            lambda: self._health(client, service, None, None),
            lock=lock,
            pool=self._watch_pool,
        )
        yield last
        backoff = Backoff(0.1, 5.0)
        while not self._alive.closed:
            try:
                new_index, current = await self._call(
                    f"watch {service}",
                    lambda index=index: self._health(client, service, index, wait_s),
                    lock=lock,
                    pool=self._watch_pool,
                    extra_s=wait_s * 17 / 16,  # Consul adds up to wait/16 of jitter
                )
            except DiscoveryError as exc:
                if isinstance(exc.__cause__, consul.ACLPermissionDenied):
                    raise
                delay = backoff.next() or 5.0
                log.warning("consul watch of %s: %s; retrying in %.1fs", service, exc, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            # An index that goes backwards (agent restart, snapshot restore) restarts
            # the blocking sequence, as Consul's documentation asks.
            # An index below 1 is reset to 1, so that the next query still blocks.
            seen = int(new_index) if new_index.isdigit() else 0
            index = None if seen < int(index or 0) else str(max(seen, 1))
            if current != last:
                last = current
                yield current

    async def close(self) -> None:
        if not await self._alive.close():
            return
        # A blocking query in flight cannot be interrupted; its thread ends by itself
        # within watch_wait_s, and its watch stops at its next turn.
        self._watch_pool.shutdown(wait=False, cancel_futures=True)
