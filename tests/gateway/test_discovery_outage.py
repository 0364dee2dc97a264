"""While discovery does not answer (its Redis restarting), the gateway routes by the last
worker listing it got instead of refusing every request with 503; with no listing yet it
still says discovery is away (Unavailable)."""

from __future__ import annotations

import pytest

from omniflow.config import load_settings
from omniflow.discovery import ServiceInstance, make_registry
from omniflow.errors import Unavailable
from omniflow.localredis import start_redis
from omniflow.workers import WORKER_SERVICE, worker_metadata
from omniflow_services.gateway.backends import Backends
from omniflow_services.gateway.config import GatewaySettings

pytestmark = pytest.mark.integration


async def test_the_last_listing_serves_while_discovery_is_away(tmp_path) -> None:
    settings = load_settings(GatewaySettings, env={}, overrides={"catalog_ttl_s": 0.0})
    meta = worker_metadata("llm", "node-a", "m", "00" * 16, ("generate",))
    with start_redis(dir=tmp_path / "redis") as redis:
        async with make_registry("redis", url=redis.url, timeout_s=1.0) as registry:
            fresh = Backends(settings, registry)
            with pytest.raises(Unavailable):  # nothing listed yet, and then no Redis
                redis.stop()
                await fresh.workers()
    with start_redis(dir=tmp_path / "redis2") as redis:
        async with make_registry("redis", url=redis.url, timeout_s=1.0) as registry:
            await registry.register(ServiceInstance(WORKER_SERVICE, "w1", "127.0.0.1:1", meta), 30)
            backends = Backends(settings, registry)
            listed = await backends.workers()
            assert [w.worker_id for w in listed] == ["w1"]
            redis.stop()
            with pytest.raises(Unavailable):
                await registry.list(WORKER_SERVICE)  # discovery itself is away ...
            again = await backends.workers()  # ... and the gateway keeps what it knew
            assert [w.worker_id for w in again] == ["w1"]
