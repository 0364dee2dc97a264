"""The gateway's in-process pick: kv_aware sends a prompt to the worker the KV index says
holds its blocks, asking a real kv-index (its gRPC MatchPrefix) once per pick, and counts
each call on its worker until its outcome. Real processes on a Redis of the test's own: the
kv-index and two echo TEST workers; the gateway's core and backends run in the test."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path

import pytest

from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.config import load_settings
from omniflow.discovery import make_registry
from omniflow.kv.events import BlockEntry, Tier
from omniflow.kv.index_store import KVIndex, OwnerInfo, OwnerKind
from omniflow.localredis import RedisProcess, redis_client
from omniflow.rpc.client import open_channel
from omniflow.sampling import SamplingParams
from omniflow.testing.launch import ServiceProc
from omniflow.values import to_python
from omniflow_services.gateway.backends import Backends
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.core import GatewayCore
from omniflow_services.worker.echo.engine import ECHO_LAYOUT

pytestmark = pytest.mark.integration

ECHO = "omniflow_services.worker"
PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # several blocks of 16 tokens


def _models_dir(tmp: Path) -> Path:
    """A folder the gateway finds the echo model's tokenizer in (a generated tiny model's)."""
    from omniflow.models.tiny import make_tiny

    models = tmp / "models"
    make_tiny("qwen2", models / "echo")
    return models


async def _calls(worker: ServiceProc) -> int:
    """The Generate calls an echo worker took (its ``stats`` operation)."""
    async with open_channel(worker.address) as channel:
        reply = await worker_pb2_grpc.WorkerServiceStub(channel).Invoke(
            worker_pb2.InvokeRequest(operation="stats"), timeout=5
        )
    return int(to_python(reply.outputs["calls"]))


async def test_kv_aware_picks_the_worker_holding_the_prefix(
    launch: Callable[..., ServiceProc], private_redis: RedisProcess, tmp_path: Path
) -> None:
    workers = {
        name: launch(ECHO, name, OMNIFLOW_WORKER_ENGINE="echo", OMNIFLOW_WORKER_ROLE="llm")
        for name in ("llm-0", "llm-1")
    }
    launch("omniflow_services.kv_index", "kv-index").wait_ready()
    for proc in workers.values():
        proc.wait_ready()
    settings = load_settings(
        GatewaySettings,
        env={},
        overrides={
            "redis_url": private_redis.url,
            "models_dir": str(_models_dir(tmp_path)),
            "kv_index": "grpc",  # through the kv-index's MatchPrefix, found in discovery
            "kv_index_timeout_s": 5.0,
            "llm_strategy": "kv_aware",
            "catalog_ttl_s": 0.0,
        },
    )
    redis = redis_client(private_redis.url, 5.0)
    async with make_registry("redis", url=private_redis.url, timeout_s=5.0) as registry:
        backends = Backends(settings, registry)
        core = GatewayCore(settings, backends)
        try:
            prep = await core.prepare_prompt("echo", PROMPT, SamplingParams(max_tokens=4))
            assert prep.namespace == ECHO_LAYOUT.namespace and len(prep.hashes) >= 4
            # llm-1 holds every block of the prompt in its device pool.
            owner = workers["llm-1"]
            index = KVIndex(redis)
            await index.start()
            await index.register_namespace(ECHO_LAYOUT)
            node = owner.info.get("metadata", {}).get("node", "") or "node-test"
            info = OwnerInfo("llm-1", node, owner.address, OwnerKind.WORKER)
            lease = await index.register_owner(info)
            entries = [BlockEntry(prep.namespace, h, Tier.DEVICE) for h in prep.hashes]
            await index.snapshot("llm-1", lease.epoch, entries)

            table = backends.picker.table
            for _ in range(6):
                picked = await core._pick(prep, ())
                assert picked.worker_id == "llm-1"
                assert table.load("llm-1") == 1  # counted on its worker until its outcome
                backends.report(picked, True)
                assert table.load("llm-1") == 0
            result = await backends.picker.pick(
                "llm", "kv_aware", namespace=prep.namespace, hashes=prep.hashes
            )
            table.finish(result.worker.worker_id, None, True)
            assert result.reachable_blocks == len(prep.hashes) and result.fallback_reason == ""
            assert result.cost == pytest.approx(0.0)
            assert not any(k.startswith("kv_fallback") for k in table.counters), table.counters

            # A whole generation goes to the owner and ends its count there.
            async with aclosing(core.generate(prep, 0)) as stream:
                chunks = [c async for c in stream]
            assert chunks and chunks[-1].finish_reason
            assert table.load("llm-1") == 0
            assert await _calls(workers["llm-1"]) == 1
            assert await _calls(workers["llm-0"]) == 0
        finally:
            await backends.close()
            await redis.aclose()
