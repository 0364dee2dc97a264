"""find_address: settings first, then discovery, the caller's node preferred or required."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from omniflow.discovery import ServiceInstance, find_address, prefer_node
from omniflow.discovery.static_backend import StaticRegistry
from omniflow.errors import Unavailable

SERVICES = """
kv-agent:
  - id: agent-a
    address: 127.0.0.1:50071
    metadata: {node: a}
  - id: agent-b
    address: 127.0.0.1:50072
    metadata: {node: b}
worker:
  - id: enc-0
    address: 127.0.0.1:50081
    metadata: {node: a, role: encoder}
  - id: enc-1
    address: 127.0.0.1:50082
    metadata: {node: b, role: encoder}
  - id: llm-0
    address: 127.0.0.1:50083
    metadata: {node: b, role: llm}
"""


@pytest.fixture
async def registry(tmp_path: Path) -> AsyncIterator[StaticRegistry]:
    path = tmp_path / "services.yaml"
    path.write_text(SERVICES)
    async with StaticRegistry(path) as reg:
        yield reg


async def test_configured_address_wins(registry: StaticRegistry) -> None:
    got = await find_address(registry, "kv-agent", configured="10.0.0.9:1", node="b")
    assert got == "10.0.0.9:1"
    assert await find_address(None, "kv-agent", configured="10.0.0.9:1") == "10.0.0.9:1"


async def test_prefers_the_callers_node(registry: StaticRegistry) -> None:
    assert await find_address(registry, "kv-agent", node="b") == "127.0.0.1:50072"
    assert await find_address(registry, "kv-agent", node="a") == "127.0.0.1:50071"
    # A node with no instance of its own falls back to the first listed.
    assert await find_address(registry, "kv-agent", node="c") == "127.0.0.1:50071"
    assert await find_address(registry, "kv-agent") == "127.0.0.1:50071"


async def test_same_node_is_required_when_asked(registry: StaticRegistry) -> None:
    assert await find_address(registry, "kv-agent", node="b", same_node=True) == "127.0.0.1:50072"
    with pytest.raises(Unavailable, match="no kv-agent is registered in discovery on node 'c'"):
        await find_address(registry, "kv-agent", node="c", same_node=True)


async def test_filter_and_its_name_in_the_error(registry: StaticRegistry) -> None:
    def encoder(i: ServiceInstance) -> bool:
        return i.metadata.get("role") == "encoder"

    got = await find_address(registry, "worker", node="b", where=encoder, what="encoder")
    assert got == "127.0.0.1:50082"
    with pytest.raises(Unavailable, match="no talker is registered"):
        await find_address(
            registry, "worker", where=lambda i: i.metadata.get("role") == "talker", what="talker"
        )
    with pytest.raises(Unavailable, match="no discovery at hand to find a encoder"):
        await find_address(None, "worker", what="encoder")


def test_prefer_node_keeps_listing_order_within_groups() -> None:
    mk = [
        ServiceInstance("s", f"i{n}", f"127.0.0.1:{5000 + n}", {"node": node})
        for n, node in enumerate("abab")
    ]
    assert [i.instance_id for i in prefer_node(mk, "b")] == ["i1", "i3", "i0", "i2"]
    assert [i.instance_id for i in prefer_node(mk, "")] == ["i0", "i1", "i2", "i3"]
