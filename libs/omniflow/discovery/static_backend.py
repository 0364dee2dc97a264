"""Static discovery from a YAML or JSON file (JSON is read as YAML).

File format: a mapping of service name to a list of instances::

    router:
      - id: router-0
        address: 127.0.0.1:50051
        metadata: {role: router}
    worker:
      - id: llm-0
        address: 127.0.0.1:50061
        metadata: {role: llm, model: tiny-qwen}

The file is the truth, and there is no liveness: every listed instance is
always "live". Hence:

* ``register`` of an instance listed under the same service with the same
  address is accepted and does nothing; anything else (unlisted id, other
  service, other address) raises :class:`DiscoveryError`, because other
  processes read only the file and could never see it;
* ``deregister`` is accepted and does nothing: the instance stays listed
  until someone edits the file;
* ``list`` re-reads the file when its modification time or size changes;
* ``watch`` polls the file every ``poll_interval_s`` and yields on change. A
  file that turns bad while watched is logged and the last good contents kept.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from omniflow.discovery.base import (
    DiscoveryError,
    Registry,
    ServiceInstance,
    check_name,
    sorted_instances,
)
from omniflow.errors import InvalidArgument

log = logging.getLogger(__name__)

# (mtime_ns, size, inode): the inode catches an editor that replaces the file by rename.
_Stamp = tuple[int, int, int]


def parse_static_file(path: Path) -> dict[str, list[ServiceInstance]]:
    """Read and validate ``path``; raises DiscoveryError naming the file and the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DiscoveryError(f"static discovery file {path}: cannot read: {exc}") from exc
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DiscoveryError(f"static discovery file {path}: not valid YAML/JSON: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise DiscoveryError(
            f"static discovery file {path}: top level must be a mapping of service name to "
            f"a list of {{id, address, metadata}}, got {type(data).__name__}"
        )
    out: dict[str, list[ServiceInstance]] = {}
    for service, entries in data.items():
        where = f"static discovery file {path}: service {service!r}"
        if not isinstance(entries, list):
            raise DiscoveryError(f"{where}: expected a list of instances")
        seen: set[str] = set()
        instances = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not {"id", "address"} <= entry.keys():
                raise DiscoveryError(f"{where}, entry {i}: expected keys id, address[, metadata]")
            unknown = entry.keys() - {"id", "address", "metadata"}
            if unknown:
                raise DiscoveryError(
                    f"{where}, entry {i}: unknown keys {sorted(unknown)}; "
                    "accepted: id, address, metadata"
                )
            metadata = entry.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise DiscoveryError(f"{where}, entry {i}: metadata must be a mapping")
            try:
                inst = ServiceInstance(
                    service=str(service),
                    instance_id=str(entry["id"]),
                    address=str(entry["address"]),
                    # YAML turns `port: 80` into an int; metadata is strings by contract.
                    metadata={str(k): str(v) for k, v in metadata.items()},
                )
            except InvalidArgument as exc:
                raise DiscoveryError(f"{where}, entry {i}: {exc}") from exc
            if inst.instance_id in seen:
                raise DiscoveryError(f"{where}: duplicate id {inst.instance_id!r}")
            seen.add(inst.instance_id)
            instances.append(inst)
        out[str(service)] = sorted_instances(instances)
    return out


class StaticRegistry(Registry):
    """Registry read from a static file (see the module docstring for the rules)."""

    def __init__(self, path: str | os.PathLike[str], *, poll_interval_s: float = 0.5) -> None:
        if poll_interval_s <= 0:
            raise InvalidArgument("poll_interval_s must be > 0")
        self._path = Path(path)
        self._poll_interval_s = poll_interval_s
        self._closed = False
        # Fail fast on a missing or bad file: a typo should stop the service at start.
        self._stamp: _Stamp | None = self._stat()
        self._data = parse_static_file(self._path)

    def _stat(self) -> _Stamp:
        try:
            st = self._path.stat()
        except OSError as exc:
            raise DiscoveryError(f"static discovery file {self._path}: {exc}") from exc
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self) -> dict[str, list[ServiceInstance]]:
        """Contents of the file, re-read only when it changed since the last read."""
        stamp = self._stat()
        if stamp != self._stamp:
            self._data = parse_static_file(self._path)
            self._stamp = stamp
        return self._data

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError("static discovery registry is closed")

    async def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        self._check_open()
        listed = {i.instance_id: i for i in self._reload().get(instance.service, [])}
        mine = listed.get(instance.instance_id)
        if mine is None:
            raise DiscoveryError(
                f"static discovery: instance {instance.instance_id!r} of service "
                f"{instance.service!r} is not listed in {self._path}; static discovery cannot "
                "add instances - list it in the file, or use the redis or consul backend"
            )
        if mine.address != instance.address:
            raise DiscoveryError(
                f"static discovery: instance {instance.instance_id!r} is listed in {self._path} "
                f"at {mine.address}, but registers at {instance.address}"
            )

    async def deregister(self, instance_id: str) -> None:
        self._check_open()
        check_name("instance id", instance_id)

    async def list(self, service: str) -> list[ServiceInstance]:
        self._check_open()
        check_name("service name", service)
        return list(self._reload().get(service, []))

    async def watch(self, service: str) -> AsyncIterator[list[ServiceInstance]]:
        last = await self.list(service)
        yield last
        bad_stamp: _Stamp | None = None  # log a bad file once, not at every poll
        while not self._closed:
            await asyncio.sleep(self._poll_interval_s)
            try:
                stamp = self._stat()
            except DiscoveryError:
                stamp = (-1, -1, -1)  # missing or unreadable
            if stamp == bad_stamp:
                continue
            try:
                current = list(self._reload().get(service, []))
            except DiscoveryError as exc:
                log.error("%s; keeping the last good contents", exc)
                bad_stamp = stamp
                continue
            bad_stamp = None
            if current != last:
                last = current
                yield current

    async def close(self) -> None:
        self._closed = True
