"""Static discovery: file reading, watching for edits, clear errors on bad files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from discovery_helpers import EVENTUALLY_S, ids, next_until

from omniflow.discovery import DiscoveryError, ServiceInstance, make_registry
from omniflow.discovery.static_backend import StaticRegistry

GOOD = """
router:
  - id: router-0
    address: 127.0.0.1:50051
    metadata: {role: router}
worker:
  - id: llm-1
    address: 127.0.0.1:50062
    metadata: {role: llm, model: tiny-qwen, port: 9100}
  - id: llm-0
    address: 127.0.0.1:50061
"""


def write(path: Path, text: str) -> None:
    # Replace by rename, as editors and config managers do.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def file(tmp_path: Path) -> Path:
    path = tmp_path / "services.yaml"
    write(path, GOOD)
    return path


async def test_reads_yaml(file: Path) -> None:
    async with StaticRegistry(file) as reg:
        workers = await reg.list("worker")
        assert ids(workers) == ["llm-0", "llm-1"]
        assert workers[1] == ServiceInstance(
            "worker",
            "llm-1",
            "127.0.0.1:50062",
            {"role": "llm", "model": "tiny-qwen", "port": "9100"},
        )
        assert await reg.list("router") == [
            ServiceInstance("router", "router-0", "127.0.0.1:50051", {"role": "router"})
        ]
        assert await reg.list("talker") == []


async def test_reads_json(tmp_path: Path) -> None:
    path = tmp_path / "services.json"
    path.write_text(json.dumps({"kv-index": [{"id": "kv-0", "address": "10.0.0.5:7000"}]}))
    async with make_registry("static", path=path) as reg:
        assert [i.address for i in await reg.list("kv-index")] == ["10.0.0.5:7000"]


async def test_register_rules(file: Path) -> None:
    async with StaticRegistry(file) as reg:
        listed = ServiceInstance("worker", "llm-0", "127.0.0.1:50061")
        await reg.register(listed, ttl_s=5)  # listed: accepted, nothing changes
        with pytest.raises(DiscoveryError, match=r"not listed in .*services\.yaml"):
            await reg.register(ServiceInstance("worker", "llm-9", "127.0.0.1:50069"), ttl_s=5)
        with pytest.raises(DiscoveryError, match="not listed"):
            await reg.register(ServiceInstance("router", "llm-0", "127.0.0.1:50061"), ttl_s=5)
        with pytest.raises(DiscoveryError, match=r"listed .* at 127\.0\.0\.1:50061"):
            await reg.register(ServiceInstance("worker", "llm-0", "127.0.0.1:1"), ttl_s=5)
        await reg.deregister("llm-0")  # accepted; the file stays the truth
        assert ids(await reg.list("worker")) == ["llm-0", "llm-1"]


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.seen.set()


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    handler = _Recorder()
    logger = logging.getLogger("omniflow.discovery.static_backend")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


async def test_watch_follows_file_edits(file: Path, recorder: _Recorder) -> None:
    bad_seen, bad_logs = recorder.seen, recorder.records
    async with StaticRegistry(file, poll_interval_s=0.05) as reg:
        async with contextlib.aclosing(reg.watch("worker")) as watch:
            assert ids(await anext(watch)) == ["llm-0", "llm-1"]
            write(file, GOOD + "  - id: llm-2\n    address: 127.0.0.1:50063\n")
            await next_until(watch, lambda listing: ids(listing) == ["llm-0", "llm-1", "llm-2"])
            # A broken edit keeps the last good contents; the next good one is picked up.
            write(file, "worker: [oops")
            pending = asyncio.ensure_future(anext(watch))
            await asyncio.wait_for(bad_seen.wait(), EVENTUALLY_S)
            assert not pending.done()  # a bad file yields nothing
            write(file, "worker:\n  - {id: llm-5, address: '127.0.0.1:50065'}\n")
            assert ids(await asyncio.wait_for(pending, EVENTUALLY_S)) == ["llm-5"]
            assert len(bad_logs) == 1  # logged once, not at every poll
            # An edit to another service only does not wake this watch with a duplicate.
            write(file, "worker:\n  - {id: llm-5, address: '127.0.0.1:50065'}\nrouter: []\n")
            write(file, "worker: []\n")
            assert await next_until(watch, lambda listing: True) == []


async def test_list_picks_up_edits(file: Path) -> None:
    async with StaticRegistry(file) as reg:
        write(file, "worker: []\n")
        assert await reg.list("worker") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker: [oops", "not valid YAML/JSON"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("worker: {id: x}\n", "expected a list of instances"),
        ("worker:\n  - {id: w-0}\n", "expected keys id, address"),
        ("worker:\n  - {id: w-0, address: 'h:1', port: 2}\n", "unknown keys \\['port'\\]"),
        ("worker:\n  - {id: w-0, address: nowhere}\n", "entry 0: bad address 'nowhere'"),
        ("worker:\n  - {id: 'w:0', address: 'h:1'}\n", "bad instance id"),
        ("worker:\n  - {id: w-0, address: 'h:1', metadata: [1]}\n", "metadata must be a mapping"),
        ("worker:\n  - {id: w, address: 'h:1'}\n  - {id: w, address: 'h:2'}\n", "duplicate id"),
    ],
)
def test_bad_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(DiscoveryError, match=message) as info:
        StaticRegistry(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"nope\.yaml"):
        StaticRegistry(tmp_path / "nope.yaml")


async def test_empty_file_lists_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    async with StaticRegistry(path) as reg:
        assert await reg.list("worker") == []
