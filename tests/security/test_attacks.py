"""One test per attack of issue 11 ("Why"), against real processes with TLS and auth ON.

Each attack is refused with UNAUTHENTICATED or PERMISSION_DENIED (or finds nothing), and
the legitimate path next to it still works. Attackers hold a certificate of the CA (a
plain client, or a worker of another node) and a tenant token: what a leaked token or a
compromised neighbour would give.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import grpc
import numpy as np
import pytest
from pki_procs import code_of

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from omniflow.api.router.v1 import router_pb2, router_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.discovery import ServiceInstance, make_registry
from omniflow.discovery.base import DiscoveryError
from omniflow.dsl import VType, Workflow, register_operation
from omniflow.kv.blocks import KVLayout, block_hashes
from omniflow.kv.checksum import page_checksum
from omniflow.kv.wire import layout_to_proto
from omniflow.security.identity import forwarded

pytestmark = pytest.mark.integration

DENIED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
LAYOUT = KVLayout("h9-security", num_layers=1, num_kv_heads=1, head_dim=16, page_size=16)
NS = LAYOUT.namespace.hex()

register_operation("echo", "upper", {"text": VType.TEXT}, {"text": VType.TEXT})


async def denied(call: Awaitable[object] | AsyncIterator[object]) -> None:
    code = await code_of(call)
    assert code in DENIED, f"expected a refusal, got {code}"


def chain_and_pages(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32000, n * LAYOUT.page_size).tolist()
    pages = [rng.integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8).tobytes() for _ in range(n)]
    return block_hashes(LAYOUT.namespace, tokens, LAYOUT.page_size), pages


def page_chunks(hashes: list[bytes], pages: list[bytes], checksums: list[int] | None = None):
    async def gen() -> AsyncIterator[kvagent_pb2.PageChunk]:
        for i, (h, data) in enumerate(zip(hashes, pages, strict=True)):
            yield kvagent_pb2.PageChunk(
                namespace=NS,
                block_hash=h,
                offset=0,
                data=data,
                page_bytes=len(data),
                checksum=checksums[i] if checksums else page_checksum(data),
                last=True,
            )

    return gen()


async def read_pages(stub: kvagent_pb2_grpc.KVAgentServiceStub, hashes: list[bytes]) -> list:
    chunks = [
        c
        async for c in stub.GetPages(kvagent_pb2.GetPagesRequest(namespace=NS, block_hashes=hashes))
    ]
    return chunks


@pytest.fixture(scope="module")
def namespace(secured) -> str:
    """The test layout registered at the index by a worker (the legitimate path)."""

    async def register() -> str:
        async with secured.channel("kv-index", "worker1") as ch:
            reply = await kvindex_pb2_grpc.KVIndexServiceStub(ch).RegisterNamespace(
                kvindex_pb2.RegisterNamespaceRequest(layout=layout_to_proto(LAYOUT))
            )
        return reply.namespace

    ns = asyncio.run(register())
    assert ns == NS
    return ns


# -- transport -----------------------------------------------------------------------------


async def test_plaintext_and_unknown_callers_are_refused(secured) -> None:
    address = secured.addr("coordinator")
    request = coordinator_pb2.ListWorkflowsRequest()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        assert await code_of(stub.ListWorkflows(request, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # TLS without a client certificate: the handshake fails (mutual TLS).
    ca = secured.bundle.ca.read_bytes()
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        assert await code_of(stub.ListWorkflows(request, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # A certificate but no token: no tenant, nothing allowed; a made-up token: unauthenticated.
    async with secured.channel("coordinator") as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        assert await code_of(stub.ListWorkflows(request)) == grpc.StatusCode.PERMISSION_DENIED
        bad = (("authorization", "Bearer not-a-token-of-this-cluster"),)
        code = await code_of(stub.ListWorkflows(request, metadata=bad))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    # The legitimate path: the tenant's token over mutual TLS.
    async with secured.channel("coordinator", token="a") as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        await stub.ListWorkflows(request)


# -- runs and workflows --------------------------------------------------------------------


def upper_workflow(name: str, suffix: str = "") -> coordinator_pb2.RegisterWorkflowRequest:
    wf = Workflow(name)
    text = wf.input("text", VType.TEXT)
    wf.output("text", wf.call("u", "echo", "upper", text=text)["text"])
    graph = wf.compile()
    graph.description = f"upper {suffix}"
    return coordinator_pb2.RegisterWorkflowRequest(graph=graph)


async def test_replace_another_tenants_workflow(secured) -> None:
    async with (
        secured.channel("coordinator", token="a") as a_ch,
        secured.channel("coordinator", token="b") as b_ch,
        secured.channel("coordinator", token="admin") as admin_ch,
    ):
        a = coordinator_pb2_grpc.CoordinatorServiceStub(a_ch)
        b = coordinator_pb2_grpc.CoordinatorServiceStub(b_ch)
        admin = coordinator_pb2_grpc.CoordinatorServiceStub(admin_ch)
        first = await a.RegisterWorkflow(upper_workflow("sec-wf-a", "by a"))
        # B cannot replace it, nor see it.
        await denied(b.RegisterWorkflow(upper_workflow("sec-wf-a", "by b")))
        code = await code_of(b.GetWorkflow(coordinator_pb2.GetWorkflowRequest(name="sec-wf-a")))
        assert code == grpc.StatusCode.NOT_FOUND
        listed = await b.ListWorkflows(coordinator_pb2.ListWorkflowsRequest())
        assert "sec-wf-a" not in {w.name for w in listed.workflows}
        # Its tenant and an admin still can.
        second = await a.RegisterWorkflow(upper_workflow("sec-wf-a", "by a again"))
        assert second.version == first.version + 1
        got = await a.GetWorkflow(coordinator_pb2.GetWorkflowRequest(name="sec-wf-a"))
        assert got.graph.description == "upper by a again"
        await admin.RegisterWorkflow(upper_workflow("sec-wf-a", "by admin"))
        listed = await a.ListWorkflows(coordinator_pb2.ListWorkflowsRequest())
        assert "sec-wf-a" in {w.name for w in listed.workflows}


async def test_list_read_and_cancel_other_runs(secured) -> None:
    async with (
        secured.channel("coordinator", token="a") as a_ch,
        secured.channel("coordinator", token="b") as b_ch,
    ):
        a = coordinator_pb2_grpc.CoordinatorServiceStub(a_ch)
        b = coordinator_pb2_grpc.CoordinatorServiceStub(b_ch)
        await a.RegisterWorkflow(upper_workflow("sec-runs-a"))
        inputs = {"text": common_pb2.Value(text="hello")}
        # B cannot run A's workflow: for B it does not exist.
        submit_b = coordinator_pb2.SubmitRunRequest(workflow="sec-runs-a", inputs=inputs)
        assert await code_of(b.SubmitRun(submit_b)) == grpc.StatusCode.NOT_FOUND
        events = [
            e
            async for e in a.RunWorkflow(
                coordinator_pb2.SubmitRunRequest(workflow="sec-runs-a", inputs=inputs),
                timeout=60,
            )
        ]
        run_id = events[-1].run_id
        run = (await a.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id))).run
        assert run.outputs["text"].text == "HELLO"
        # B can neither read, follow nor cancel it; nor take its id for a run of its own.
        for call in (
            b.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id)),
            b.CancelRun(coordinator_pb2.CancelRunRequest(run_id=run_id)),
            b.StreamRunEvents(coordinator_pb2.StreamRunEventsRequest(run_id=run_id)),
        ):
            assert await code_of(call) == grpc.StatusCode.NOT_FOUND
        await b.RegisterWorkflow(upper_workflow("sec-runs-b"))
        steal = coordinator_pb2.SubmitRunRequest(
            workflow="sec-runs-b", inputs=inputs, run_id=run_id
        )
        assert await code_of(b.SubmitRun(steal)) == grpc.StatusCode.PERMISSION_DENIED
        again = (await a.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id))).run
        assert again.outputs["text"].text == "HELLO"


async def test_only_forwarding_services_may_name_a_tenant(secured) -> None:
    inputs = {"text": common_pb2.Value(text="fwd")}
    async with secured.channel("coordinator", token="a") as ch:
        a = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        await a.RegisterWorkflow(upper_workflow("sec-fwd-a"))
        submit = coordinator_pb2.SubmitRunRequest(workflow="sec-fwd-a", inputs=inputs)
        run_id = (await a.SubmitRun(submit)).run_id
    get = coordinator_pb2.GetRunRequest(run_id=run_id)
    # A coordinator (a forwarder, like the gateway) acting for tenant-a sees the run; acting
    # for tenant-b it does not.
    async with secured.channel("coordinator", "coord") as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        run = (await stub.GetRun(get, metadata=forwarded("tenant-a"))).run
        assert run.run_id == run_id
        code = await code_of(stub.GetRun(get, metadata=forwarded("tenant-b")))
        assert code == grpc.StatusCode.NOT_FOUND
    # A plain client or a worker naming a tenant is not believed.
    for caller in ("client", "worker1"):
        async with secured.channel("coordinator", caller) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            code = await code_of(stub.GetRun(get, metadata=forwarded("tenant-a")))
            assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND), code


# -- generations ---------------------------------------------------------------------------


async def test_abort_another_clients_generation(secured) -> None:
    request = worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(5, 40))),
        sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    )
    async with (
        secured.channel("router", token="a") as a_ch,
        secured.channel("router", token="b") as b_ch,
    ):
        a = worker_pb2_grpc.WorkerServiceStub(a_ch)
        b = worker_pb2_grpc.WorkerServiceStub(b_ch)
        stream = a.Generate(request, timeout=60)
        chunks = []
        aborted = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                # The attacker guesses ids the old counter gave out.
                for guess in ("gen-0", "gen-1", "gen-2", "0", "1"):
                    aborted.append((await b.Abort(worker_pb2.AbortRequest(request_id=guess))).found)
    assert not any(aborted)
    rid = chunks[0].request_id
    assert rid.startswith("gen-") and len(rid) == len("gen-") + 32  # 128 random bits
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 24
    assert chunks[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH


async def test_load_model_any_folder_through_the_router(secured) -> None:
    request = worker_pb2.LoadModelRequest(model_path="/etc")
    async with secured.channel("router", token="a") as ch:
        await denied(worker_pb2_grpc.WorkerServiceStub(ch).LoadModel(request))
    async with secured.channel("llm-1", token="a") as ch:
        await denied(worker_pb2_grpc.WorkerServiceStub(ch).LoadModel(request))
    async with secured.channel("llm-1", "worker1") as ch:  # a neighbour worker, no token
        await denied(worker_pb2_grpc.WorkerServiceStub(ch).LoadModel(request))
    # An admin's call passes the router and reaches the worker, which judges the folder.
    async with secured.channel("router", token="admin") as ch:
        code = await code_of(worker_pb2_grpc.WorkerServiceStub(ch).LoadModel(request, timeout=30))
    assert code not in DENIED and code != grpc.StatusCode.OK, code


# -- router --------------------------------------------------------------------------------


async def test_open_a_breaker_with_fake_outcomes(secured) -> None:
    llm = "llm-1"
    fake = router_pb2.ReportOutcomesRequest(
        outcomes=[
            router_pb2.ReportOutcomeRequest(worker_id=llm, success=False, error_code="UNAVAILABLE")
            for _ in range(50)
        ]
    )
    async with secured.channel("router", token="a") as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        await denied(stub.ReportOutcomes(fake))
        await denied(stub.ReportOutcome(fake.outcomes[0]))
    async with secured.channel("router", "worker1") as ch:
        await denied(router_pb2_grpc.RouterServiceStub(ch).ReportOutcomes(fake))
    async with secured.channel("router", token="a") as ch:
        stats = await router_pb2_grpc.RouterServiceStub(ch).GetStats(router_pb2.GetStatsRequest())
    assert stats.breakers.get(llm, "closed") == "closed"
    # A coordinator (a router's client) reports a success: accepted.
    good = router_pb2.ReportOutcomeRequest(worker_id=llm, success=True, latency_ms=1.0)
    async with secured.channel("router", "coord") as ch:
        await router_pb2_grpc.RouterServiceStub(ch).ReportOutcome(good)


async def test_register_a_fake_worker_in_discovery(secured) -> None:
    # Discovery is Redis, which wants its password: without it nothing can be written.
    url = secured.redis.url.replace(f":{secured.redis.password}@", "")
    assert secured.redis.password and secured.redis.password not in url
    registry = make_registry("redis", url=url)
    fake = ServiceInstance("worker", "evil", "127.0.0.1:1", {"role": "llm", "node": "node-1"})
    try:
        with pytest.raises(DiscoveryError, match="AuthenticationError"):
            await registry.register(fake, 30.0)
    finally:
        await registry.close()
    async with secured.channel("router", token="a") as ch:
        listed = await router_pb2_grpc.RouterServiceStub(ch).ListWorkers(
            router_pb2.ListWorkersRequest()
        )
    ids = {w.worker_id for w in listed.workers}
    assert "evil" not in ids and "llm-1" in ids


# -- KV index ------------------------------------------------------------------------------


async def test_probe_match_prefix_across_tenants(secured, namespace) -> None:
    hashes, _ = chain_and_pages(2, seed=1)
    request = kvindex_pb2.MatchPrefixRequest(namespace=namespace, block_hashes=hashes)
    async with secured.channel("kv-index", token="b") as ch:
        await denied(kvindex_pb2_grpc.KVIndexServiceStub(ch).MatchPrefix(request))
    async with secured.channel("kv-index") as ch:
        await denied(kvindex_pb2_grpc.KVIndexServiceStub(ch).MatchPrefix(request))
    async with secured.channel("kv-index", "worker1") as ch:  # services route with it
        await kvindex_pb2_grpc.KVIndexServiceStub(ch).MatchPrefix(request)


async def test_take_over_another_owners_lease(secured) -> None:
    victim = "agent-1"
    async with secured.channel("kv-index", "worker1") as ch:
        stub = kvindex_pb2_grpc.KVIndexServiceStub(ch)
        take = kvindex_pb2.AcquireLeaseRequest(
            owner_id=victim, kind=kvindex_pb2.OWNER_KIND_AGENT, node="node-1", address="x:1"
        )
        await denied(stub.AcquireLease(take))
        await denied(stub.Heartbeat(kvindex_pb2.HeartbeatRequest(owner_id=victim, epoch=1)))
        await denied(stub.ReleaseLease(kvindex_pb2.ReleaseLeaseRequest(owner_id=victim, epoch=1)))
        publish = kvindex_pb2.PublishEventsRequest(owner_id=victim, epoch=1, seq=1)
        await denied(stub.PublishEvents(publish))
        # Its own lease, on its own node, is the legitimate path; another node is not.
        own = kvindex_pb2.AcquireLeaseRequest(
            owner_id="w-test", kind=kvindex_pb2.OWNER_KIND_WORKER, node="node-1", address="x:2"
        )
        lease = await stub.AcquireLease(own)
        assert lease.epoch >= 1
        other_node = kvindex_pb2.AcquireLeaseRequest(
            owner_id="w-test", kind=kvindex_pb2.OWNER_KIND_WORKER, node="node-2", address="x:2"
        )
        await denied(stub.AcquireLease(other_node))
        await stub.ReleaseLease(
            kvindex_pb2.ReleaseLeaseRequest(owner_id="w-test", epoch=lease.epoch)
        )
    async with secured.channel("kv-index", token="a") as ch:
        await denied(kvindex_pb2_grpc.KVIndexServiceStub(ch).AcquireLease(take))


# -- KV agent ------------------------------------------------------------------------------


async def test_read_another_tenants_pages(secured, namespace) -> None:
    hashes, pages = chain_and_pages(2, seed=2)
    async with secured.channel("agent-1", "worker1") as ch:
        put = await kvagent_pb2_grpc.KVAgentServiceStub(ch).PutPages(page_chunks(hashes, pages))
        assert put.stored == 2
    # A tenant's client, a coordinator, a worker of another node: none reads the pages.
    for caller, token in (("client", "b"), ("coord", None), ("worker2", None)):
        async with secured.channel("agent-1", caller, token) as ch:
            stub = kvagent_pb2_grpc.KVAgentServiceStub(ch)
            await denied(
                stub.GetPages(kvagent_pb2.GetPagesRequest(namespace=NS, block_hashes=hashes))
            )
            locate = kvagent_pb2.LocatePagesRequest(namespace=NS, block_hashes=hashes)
            await denied(stub.LocatePages(locate))
            await denied(stub.GetArena(kvagent_pb2.GetArenaRequest(namespace=NS)))
    async with secured.channel("agent-1", "worker1") as ch:
        chunks = await read_pages(kvagent_pb2_grpc.KVAgentServiceStub(ch), hashes)
    assert b"".join(c.data for c in chunks) == b"".join(pages)


async def test_poison_pages_with_sender_made_checksums(secured, namespace) -> None:
    hashes, pages = chain_and_pages(2, seed=3)
    async with secured.channel("agent-1", "worker1") as ch:
        good = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        assert (await good.PutPages(page_chunks(hashes, pages))).stored == 2
        junk = [bytes(len(p)) for p in pages]
        for caller, token in (("client", "b"), ("worker2", None), ("coord", None)):
            async with secured.channel("agent-1", caller, token) as evil_ch:
                evil = kvagent_pb2_grpc.KVAgentServiceStub(evil_ch)
                evict = kvagent_pb2.EvictRequest(namespace=NS, block_hashes=hashes)
                await denied(evil.Evict(evict))
                # Junk under the victim's hashes, with checksums the sender made for it.
                await denied(evil.PutPages(page_chunks(hashes, junk)))
        # Even a node worker's page is checksummed by the agent: a checksum that does not
        # match the bytes (made for other bytes) is refused, and nothing is replaced.
        other, other_pages = chain_and_pages(1, seed=33)
        lie = [page_checksum(other_pages[0])]
        reply = await good.PutPages(page_chunks(other, [bytes(LAYOUT.page_bytes)], lie))
        assert reply.stored == 0 and reply.rejected == 1
        chunks = await read_pages(good, hashes)
    assert b"".join(c.data for c in chunks) == b"".join(pages)
    assert [c.checksum for c in chunks] == [page_checksum(p) for p in pages]


async def test_empty_a_nodes_host_tier(secured, namespace) -> None:
    hashes, pages = chain_and_pages(3, seed=4)
    async with secured.channel("agent-1", "worker1") as ch:
        assert (
            await kvagent_pb2_grpc.KVAgentServiceStub(ch).PutPages(page_chunks(hashes, pages))
        ).stored == 3
    by_budget = kvagent_pb2.EvictRequest(namespace=NS, target_free_bytes=1 << 40)
    for caller, token in (("client", "a"), ("worker2", None)):
        async with secured.channel("agent-1", caller, token) as ch:
            await denied(kvagent_pb2_grpc.KVAgentServiceStub(ch).Evict(by_budget))
    async with secured.channel("agent-1", "worker1") as ch:
        chunks = await read_pages(kvagent_pb2_grpc.KVAgentServiceStub(ch), hashes)
    assert len(chunks) == 3


async def test_lock_host_slots_with_a_huge_ttl(secured, namespace) -> None:
    forever = 49 * 24 * 3600 * 1000
    hashes, _ = chain_and_pages(2, seed=5)
    lock = kvagent_pb2.CommitPagesRequest(namespace=NS, reserve=64, reservation_ttl_ms=forever)
    pin = kvagent_pb2.LocatePagesRequest(namespace=NS, block_hashes=hashes, pin_ttl_ms=forever)
    for caller, token in (("client", "b"), ("worker2", None)):
        async with secured.channel("agent-1", caller, token) as ch:
            stub = kvagent_pb2_grpc.KVAgentServiceStub(ch)
            await denied(stub.CommitPages(lock))
            await denied(stub.LocatePages(pin))
    # A node worker reserves (the TTL is capped by the agent) and gives the slots back.
    async with secured.channel("agent-1", "worker1") as ch:
        stub = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        reply = await stub.CommitPages(
            kvagent_pb2.CommitPagesRequest(namespace=NS, reserve=2, reservation_ttl_ms=forever)
        )
        assert len(reply.reserved_slots) == 2
        await stub.CommitPages(
            kvagent_pb2.CommitPagesRequest(namespace=NS, abort_slots=list(reply.reserved_slots))
        )


async def test_pull_pages_from_any_address(secured, namespace) -> None:
    hashes, pages = chain_and_pages(2, seed=6)
    async with secured.channel("agent-2", "worker2") as ch:
        assert (
            await kvagent_pb2_grpc.KVAgentServiceStub(ch).PutPages(page_chunks(hashes, pages))
        ).stored == 2
    anywhere = kvagent_pb2.PullPagesRequest(
        namespace=NS, block_hashes=hashes, source_address="127.0.0.1:9", channel="grpc"
    )
    from_agent2 = kvagent_pb2.PullPagesRequest(
        namespace=NS, block_hashes=hashes, source_address=secured.addr("agent-2"), channel="grpc"
    )
    async with secured.channel("agent-1", token="a") as ch:
        await denied(kvagent_pb2_grpc.KVAgentServiceStub(ch).PullPages(from_agent2))
    async with secured.channel("agent-1", "worker1") as ch:
        stub = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        # A node worker may pull, but only from an agent found in discovery.
        assert await code_of(stub.PullPages(anywhere)) == grpc.StatusCode.PERMISSION_DENIED
        pulled = await stub.PullPages(from_agent2)
        assert pulled.pulled == 2 and pulled.checksum_failures == 0
        chunks = await read_pages(stub, hashes)
    assert b"".join(c.data for c in chunks) == b"".join(pages)
