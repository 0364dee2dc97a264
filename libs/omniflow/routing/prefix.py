"""How the pick policy asks the KV index which owners hold a prompt's leading blocks.

Two ways, behind one small interface (``prefix_index`` opens the one the settings name):
the kv-index's gRPC ``MatchPrefix`` (the normal one), or the index's store straight against
its Redis (``omniflow.kv.index_store``, the library module that owns the key layout; for
deployments, tests and benches where the kv-index edge is not there). Either answers
within the pick's deadline or the pick falls back to load only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.errors import Unavailable
from omniflow.kv.index_store import KVIndex, OwnerMatch
from omniflow.kv.wire import namespace_fields
from omniflow.localredis import redis_client
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel

_KIND = {kvindex_pb2.OWNER_KIND_WORKER: "worker", kvindex_pb2.OWNER_KIND_AGENT: "agent"}


class PrefixIndex(Protocol):
    async def match(self, namespace: bytes, hashes: Sequence[bytes]) -> list[OwnerMatch]: ...

    async def close(self) -> None: ...


class GrpcPrefixIndex:
    """``MatchPrefix`` on the kv-index service (address from settings or discovery).

    The address is resolved once and its channel kept: a pick costs the one MatchPrefix
    call, not a discovery listing before it (a Redis round trip per pick). A failed call
    drops the channel, so that the next pick resolves the address again (a restarted
    index on another port)."""

    def __init__(self, resolve: Callable[[], Awaitable[str]]) -> None:
        self._resolve = resolve
        self._channel: tuple[str, TracedChannel, kvindex_pb2_grpc.KVIndexServiceStub] | None = None

    async def match(self, namespace: bytes, hashes: Sequence[bytes]) -> list[OwnerMatch]:
        if self._channel is None:
            address = await self._resolve()
            if self._channel is None:  # no concurrent pick opened one meanwhile
                channel = open_channel(address, max_in_flight=None)
                stub = kvindex_pb2_grpc.KVIndexServiceStub(channel)
                self._channel = (address, channel, stub)
        _, channel, stub = self._channel
        try:
            reply = await stub.MatchPrefix(
                kvindex_pb2.MatchPrefixRequest(
                    **namespace_fields(namespace), block_hashes=list(hashes)
                )
            )
        except Unavailable:  # not a deadline: a slow index keeps its channel
            if self._channel is not None and self._channel[1] is channel:
                self._channel = None
                await channel.close()
            raise
        merged: dict[str, list[int]] = {}
        meta: dict[str, kvindex_pb2.OwnerMatch] = {}
        for o in reply.owners:
            # One row per owner and tier: the leading blocks it holds in that tier.
            per_tier = merged.setdefault(o.owner_id, [0, 0, 0])
            tier = max(o.tier - 1, 0)
            per_tier[tier] = max(per_tier[tier], o.matched_blocks)
            meta.setdefault(o.owner_id, o)
        return [
            OwnerMatch(
                owner_id=oid,
                kind=_KIND.get(meta[oid].kind, "agent"),
                node=meta[oid].node,
                address=meta[oid].address,
                matched_blocks=max(per_tier),
                blocks_per_tier=(per_tier[0], per_tier[1], per_tier[2]),
            )
            for oid, per_tier in merged.items()
        ]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel[1].close()


class RedisPrefixIndex:
    """The index core (``omniflow.kv.index_store.KVIndex``) on the index's Redis; every
    command has ``timeout_s`` as its socket deadline."""

    def __init__(self, redis_url: str, timeout_s: float, key_prefix: str = "of:kv:") -> None:
        self._redis = redis_client(redis_url, timeout_s)
        self._index = KVIndex(self._redis, prefix=key_prefix)
        self._started = False
        self._lock = asyncio.Lock()

    async def match(self, namespace: bytes, hashes: Sequence[bytes]) -> list[OwnerMatch]:
        if not self._started:
            async with self._lock:
                if not self._started:
                    await self._index.start()
                    self._started = True
        result = await self._index.match_prefix(namespace, list(hashes))
        return list(result.owners)

    async def close(self) -> None:
        await self._redis.aclose()


def prefix_index(
    way: str,
    resolve: Callable[[], Awaitable[str]],
    redis_url: str,
    timeout_s: float,
    key_prefix: str = "of:kv:",
) -> PrefixIndex | None:
    """The index ``way`` names (``OMNIFLOW_ROUTER_KV_INDEX``): ``grpc`` (``resolve`` gives
    the kv-index's address), ``redis``, ``auto`` (the index's own Redis when ``redis_url``
    is set: one round trip, else grpc) or ``off`` (None: kv_aware picks by load only)."""
    if way == "auto":
        way = "redis" if redis_url else "grpc"
    if way == "grpc":
        return GrpcPrefixIndex(resolve)
    if way == "redis":
        return RedisPrefixIndex(redis_url, timeout_s, key_prefix)
    return None
