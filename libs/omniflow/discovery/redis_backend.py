"""Redis discovery backend: the single-machine default.

Key layout (``{p}`` is the configurable prefix, ``omniflow`` by default)::

    {p}:svc:{service}:{instance_id}   STRING  JSON of ServiceInstance.to_dict(), with a TTL
                                              (PX); refreshed every ttl/3 while alive
    {p}:svcidx:{service}              SET     instance ids of the service; members whose
                                              key has expired are pruned when listed
    {p}:svcevents:{service}           PUBSUB  "register <id>" / "deregister <id>" notices

Liveness: a registration exists only while its key does. A process that dies
without deregistering (SIGKILL) stops refreshing, its key expires after the
TTL, and the next listing drops it.

Watch: a watcher subscribes to the service's channel and re-lists on every
notice, so explicit register/deregister are seen at once; it also re-lists
every ``poll_interval_s`` because key expiry publishes nothing here (keyspace
notifications are off by default and need server configuration), so a dead
instance disappears within TTL + poll interval.

The listing script reads instance keys not named in KEYS, so this layout
suits a single Redis (or a Redis cluster only with all keys in one slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from omniflow.discovery.base import DiscoveryError, ServiceInstance, TTLRegistry
from omniflow.errors import InvalidArgument
from omniflow.localredis import redis_client

log = logging.getLogger(__name__)

# Lists live members and prunes dead ones atomically, so that a concurrent
# register (SET, then SADD) can never lose its set member to a stale prune.
_LIST_SCRIPT = """
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for _, id in ipairs(ids) do
  local v = redis.call('GET', ARGV[1] .. id)
  if v then
    out[#out + 1] = v
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
"""


def _redact(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisRegistry(TTLRegistry):
    """Registry on a Redis server (see the module docstring for the key layout)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "omniflow",
        timeout_s: float = 5.0,
        poll_interval_s: float = 1.0,
    ) -> None:
        if timeout_s <= 0 or poll_interval_s <= 0:
            raise InvalidArgument("timeout_s and poll_interval_s must be > 0")
        if not prefix or any(c in prefix for c in "*?[] "):
            raise InvalidArgument(f"bad key prefix {prefix!r}: must be non-empty, no glob chars")
        super().__init__("redis")
        self._url = url
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._poll_interval_s = poll_interval_s
        # After a Redis restart (or a Sentinel failover: redis+sentinel:// URLs) every pooled
        # connection is stale once: reconnect and retry. All our writes are idempotent.
        self._redis: aioredis.Redis = redis_client(url, timeout_s, decode_responses=True)
        self._list_script = self._redis.register_script(_LIST_SCRIPT)
        self._pubsubs: set[Any] = set()

    # -- keys -----------------------------------------------------------------

    def _key(self, service: str, instance_id: str) -> str:
        return f"{self._prefix}:svc:{service}:{instance_id}"

    def _index_key(self, service: str) -> str:
        return f"{self._prefix}:svcidx:{service}"

    def _channel(self, service: str) -> str:
        return f"{self._prefix}:svcevents:{service}"

    # -- plumbing -------------------------------------------------------------

    async def _run(self, what: str, coro: Any) -> Any:
        """Await a Redis call under the registry's timeout, mapping failures to DiscoveryError."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            raise DiscoveryError(
                f"redis discovery at {_redact(self._url)}: {what} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def _write(self, instance: ServiceInstance, ttl_s: float, announce: bool) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(
            self._key(instance.service, instance.instance_id),
            json.dumps(instance.to_dict(), sort_keys=True),
            px=max(1, round(ttl_s * 1000)),
        )
        pipe.sadd(self._index_key(instance.service), instance.instance_id)
        if announce:
            pipe.publish(self._channel(instance.service), f"register {instance.instance_id}")
        await self._run(f"register {instance.service}/{instance.instance_id}", pipe.execute())

    async def _refresh_loop(self, instance: ServiceInstance, ttl_s: float) -> None:
        period = ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self._write(instance, ttl_s, announce=False)
            except DiscoveryError as exc:
                # Keep trying: the registration lapses after the TTL, and comes back
                # with the next successful refresh once Redis answers again.
                log.warning(
                    "refresh of %s/%s failed: %s", instance.service, instance.instance_id, exc
                )

    # -- Registry -------------------------------------------------------------

    async def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        self._alive.begin(instance, ttl_s)
        previous = self._alive.registered.get(instance.instance_id)
        if previous is not None and previous[0].service != instance.service:
            await self.deregister(instance.instance_id)
        await self._write(instance, ttl_s, announce=True)
        self._alive.keep(instance, ttl_s, self._refresh_loop(instance, ttl_s))

    async def _find_service(self, instance_id: str) -> list[str]:
        """Services that hold a key for ``instance_id`` (an id registered by another process)."""
        pattern = f"{self._prefix}:svc:*:{instance_id}"
        head = f"{self._prefix}:svc:"

        async def scan() -> list[str]:
            found = []
            async for key in self._redis.scan_iter(match=pattern, count=500):
                service, _, rest = key[len(head) :].partition(":")
                if rest == instance_id:
                    found.append(service)
            return found

        return await self._run(f"lookup of {instance_id}", scan())

    async def deregister(self, instance_id: str) -> None:
        self._opened("instance id", instance_id)
        known = self._alive.forget(instance_id)
        services = [known[0].service] if known else await self._find_service(instance_id)
        for service in services:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self._key(service, instance_id))
            pipe.srem(self._index_key(service), instance_id)
            pipe.publish(self._channel(service), f"deregister {instance_id}")
            await self._run(f"deregister {service}/{instance_id}", pipe.execute())

    async def list(self, service: str) -> list[ServiceInstance]:
        self._opened("service name", service)
        raw = await self._run(
            f"list {service}",
            self._list_script(
                keys=[self._index_key(service)], args=[f"{self._prefix}:svc:{service}:"]
            ),
        )
        return self._instances(
            service, raw, lambda item: ServiceInstance.from_dict(json.loads(item))
        )

    async def _wait_for_notice(self, pubsub: Any, timeout_s: float) -> None:
        """Return on the first change notice, or after ``timeout_s`` without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            except (RedisError, OSError) as exc:
                log.warning("discovery watch lost its subscription, will poll: %s", exc)
                await asyncio.sleep(left)
                return
            if msg is not None:
                return

    async def watch(self, service: str) -> AsyncIterator[list[ServiceInstance]]:
        self._opened("service name", service)
        pubsub = self._redis.pubsub()
        self._pubsubs.add(pubsub)
        try:
            # Subscribe before the first listing, so no change falls in between.
            await self._run(f"subscribe to {service}", pubsub.subscribe(self._channel(service)))
            last = await self.list(service)
            yield last
            while not self._alive.closed:
                await self._wait_for_notice(pubsub, self._poll_interval_s)
                if self._alive.closed:
                    break
                try:
                    current = await self.list(service)
                except DiscoveryError as exc:
                    log.warning("discovery watch of %s: %s; retrying", service, exc)
                    continue
                if current != last:
                    last = current
                    yield current
        finally:
            self._pubsubs.discard(pubsub)
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    async def close(self) -> None:
        if not await self._alive.close():
            return
        for pubsub in list(self._pubsubs):
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
        await self._redis.aclose()
