"""A page moves over NIXL only under a grant asked over mutual TLS: real processes.

A secured topology (Redis with a password, a kv-index, kv-agents on node-1 and node-2, all
on mutual TLS from one CA). The test process holds a worker of each node and a third
kv-agent identity, the spy, with a NIXL agent of its own on the same UCX devices: it
reaches agent-2's UCX port and may call the agents' gRPC API, but holds no grant.

- agent-2's GetTransport hands out no NIXL metadata; with only that, the spy's READ of an
  arena slot fails (NIXL knows no registration of agent-2's);
- with a grant (LocatePages with nixl_grant) the spy READs the granted pages, byte for
  byte, and nothing else: a READ of a slot outside the grant fails;
- a grant is only for kv-agents (a worker or a tenant is PERMISSION_DENIED), and only the
  identity it was granted to releases it;
- agent-1's PullPages over NIXL (its own grant per pull) moves every page.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from kv_helpers import LAYOUT, chain, pages

from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.config import SecuritySettings
from omniflow.kv.checksum import page_checksum
from omniflow.kv.wire import layout_to_proto, namespace_fields
from omniflow.localredis import RedisProcess, start_redis
from omniflow.rpc.client import open_channel
from omniflow.rpc.interceptors import TracedChannel
from omniflow.security.bundle import Bundle, make_bundle
from omniflow.security.identity import Identity
from omniflow.security.transport import Security
from omniflow.testing.launch import ServiceProc, start_service, stop_all
from omniflow_services.kv_agent.nixl_channel import NixlChannel, nixl_unavailable_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
    ),
]

SERVICES = {
    "kv-index": Identity("kv-index", "node-1", "kv-index"),
    "agent-1": Identity("kv-agent", "node-1", "agent-1"),
    "agent-2": Identity("kv-agent", "node-2", "agent-2"),
}
CALLERS = {
    "worker1": Identity("worker", "node-1", "w1"),
    "worker2": Identity("worker", "node-2", "w2"),
    "spy": Identity("kv-agent", "node-3", "spy"),
    "client": Identity("client", "laptop", "cli"),
}
NS = LAYOUT.namespace
PB = LAYOUT.page_bytes


@dataclass
class Topo:
    bundle: Bundle
    procs: dict[str, ServiceProc]
    token: str

    def channel(self, name: str, caller: str, token: str = "") -> TracedChannel:
        issued = self.bundle.certs[CALLERS[caller].uri]
        sec = Security.load(
            SecuritySettings(
                tls="on",
                tls_ca=str(self.bundle.ca),
                tls_cert=str(issued.cert),
                tls_key=str(issued.key),
                token=token,
            )
        )
        return open_channel(self.procs[name].address, security=sec)


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topo]:
    folder = tmp_path_factory.mktemp("nixlgrant")
    idents = [*SERVICES.values(), *CALLERS.values()]
    bundle = make_bundle(folder / "pki", idents, ["tenant-a:user"])
    redis: RedisProcess = start_redis(dir=folder / "redis", password=secrets.token_hex(16))
    started: list[ServiceProc] = []
    tag = f"g{os.getpid()}"

    def start(module: str, name: str, **env: str) -> ServiceProc:
        ident = SERVICES[name]
        full = {
            **bundle.env_for(ident),
            "OMP_NUM_THREADS": "1",
            "OMNIFLOW_INSTANCE_ID": ident.instance,
            "OMNIFLOW_NODE_ID": ident.node,
            "OMNIFLOW_HOST": "127.0.0.1",
            **env,
            "OMNIFLOW_TOKEN": "",
        }
        proc = start_service(module, name, tmp=folder, redis_url=redis.url, **full)
        started.append(proc)
        return proc

    try:
        procs = {"kv-index": start("omniflow_services.kv_index", "kv-index").wait_ready(60)}
        for name in ("agent-1", "agent-2"):
            procs[name] = start(
                "omniflow_services.kv_agent",
                name,
                OMNIFLOW_KV_HOST_BYTES=str(2 * 1024 * 1024),
                OMNIFLOW_KV_SHM_TAG=f"{tag}{name}",
                OMNIFLOW_KV_CHANNELS="grpc,nixl",
            )
        for name in ("agent-1", "agent-2"):
            procs[name].wait_ready(60)
        yield Topo(bundle, procs, bundle.tokens["tenant-a:user"])
    finally:
        stop_all(started)
        redis.stop()


def _chunks(hashes: list[bytes], data: list[bytes]) -> AsyncIterator[kvagent_pb2.PageChunk]:
    async def gen() -> AsyncIterator[kvagent_pb2.PageChunk]:
        for h, blob in zip(hashes, data, strict=True):
            yield kvagent_pb2.PageChunk(
                **namespace_fields(NS), block_hash=h, offset=0, data=blob, page_bytes=len(blob),
                checksum=page_checksum(blob), last=True,
            )  # fmt: skip

    return gen()


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_nixl_read_needs_a_grant(topo: Topo) -> None:
    asyncio.run(_needs_a_grant(topo))


async def _needs_a_grant(topo: Topo) -> None:
    hashes, data = chain(6, seed=41), pages(6, seed=41)
    async with topo.channel("kv-index", "worker1") as ch:
        await kvindex_pb2_grpc.KVIndexServiceStub(ch).RegisterNamespace(
            kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(LAYOUT))
        )
    async with topo.channel("agent-2", "worker2") as ch:
        w2 = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        assert (await w2.PutPages(_chunks(hashes, data))).stored == 6
        # Where the pages are (the node's own worker may look; no grant for it).
        held = await w2.LocatePages(
            kvagent_pb2.LocatePagesRequest(**namespace_fields(NS), block_hashes=hashes)
        )
        slots = {ref.block_hash: ref.slot for ref in held.slots}
        await w2.Unpin(kvagent_pb2.UnpinRequest(pin_id=held.pin_id))
        grant_for_worker = kvagent_pb2.LocatePagesRequest(
            **namespace_fields(NS), block_hashes=hashes, nixl_grant=True
        )
        assert await _code(w2.LocatePages(grant_for_worker)) == grpc.StatusCode.PERMISSION_DENIED
    async with topo.channel("agent-2", "client", topo.token) as ch:
        tenant = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        assert (
            await _code(tenant.LocatePages(grant_for_worker)) == grpc.StatusCode.PERMISSION_DENIED
        )

    spy = NixlChannel(f"spy-{secrets.token_hex(4)}", "lo")
    buf = np.zeros((6, PB), dtype=np.uint8)
    try:
        await spy.register(buf.ctypes.data, buf.nbytes)
        rows = [buf.ctypes.data + i * PB for i in range(6)]
        async with topo.channel("agent-2", "spy") as ch:
            stub = kvagent_pb2_grpc.KVAgentServiceStub(ch)
            transport = await stub.GetTransport(kvagent_pb2.GetTransportRequest())
            assert "nixl" in transport.channels and transport.nixl_metadata == b""
            arena = await stub.GetArena(kvagent_pb2.GetArenaRequest(**namespace_fields(NS)))
            base = arena.base_address + arena.data_offset

            def addr(h: bytes) -> int:
                return base + slots[h] * arena.slot_stride

            # No grant: NIXL has nothing of agent-2's to READ.
            with pytest.raises(Exception):  # noqa: B017 - NIXL's own NotFound error type
                await spy.read(transport.nixl_agent_name, rows[:1], [addr(hashes[0])], PB, 5.0)
            assert not buf.any()
            # A grant for the first three pages: those READ, byte for byte.
            granted = await stub.LocatePages(
                kvagent_pb2.LocatePagesRequest(
                    **namespace_fields(NS), block_hashes=hashes[:3], nixl_grant=True
                )
            )
            assert len(granted.slots) == 3 and granted.nixl_metadata
            remote = await spy.ensure_remote(granted.nixl_metadata)
            await spy.read(remote, rows[:3], [addr(h) for h in hashes[:3]], PB, 5.0)
            assert [buf[i].tobytes() for i in range(3)] == data[:3]
            # ...and nothing outside it: the pages not granted do not READ.
            with pytest.raises(Exception):  # noqa: B017
                await spy.read(remote, rows[3:4], [addr(hashes[3])], PB, 5.0)
            assert not buf[3].any()
            # Only the identity granted releases the grant.
            async with topo.channel("agent-2", "worker2") as wch:
                other = kvagent_pb2_grpc.KVAgentServiceStub(wch)
                code = await _code(other.Unpin(kvagent_pb2.UnpinRequest(pin_id=granted.pin_id)))
                assert code == grpc.StatusCode.NOT_FOUND
            await stub.Unpin(kvagent_pb2.UnpinRequest(pin_id=granted.pin_id))
            code = await _code(stub.Unpin(kvagent_pb2.UnpinRequest(pin_id=granted.pin_id)))
            assert code == grpc.StatusCode.NOT_FOUND  # released once
    finally:
        await asyncio.to_thread(spy.close)

    # The legitimate path: agent-1 pulls over NIXL under its own grant.
    async with topo.channel("agent-1", "worker1") as ch:
        w1 = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        pulled = await w1.PullPages(
            kvagent_pb2.PullPagesRequest(
                **namespace_fields(NS), block_hashes=hashes,
                source_address=topo.procs["agent-2"].address, channel="nixl",
            )
        )  # fmt: skip
        assert pulled.channel == "nixl" and pulled.pulled == 6 and pulled.checksum_failures == 0
        got = [
            c
            async for c in w1.GetPages(
                kvagent_pb2.GetPagesRequest(**namespace_fields(NS), block_hashes=hashes)
            )
        ]
        assert b"".join(c.data for c in got) == b"".join(data)
