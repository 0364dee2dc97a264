"""The coordinator's core: the workflow catalogue, kept in Redis so that every
coordinator replica (and a restarted one) sees the same workflows.

Key layout: ``omniflow:workflows`` is a hash of workflow name → JSON summary
``{"name", "latest_version", "description"}``; each version's graph lives under
``omniflow:workflow:{name}:{version}`` (a serialized ``WorkflowGraph``), and
``omniflow:workflow:{name}:seq`` counts versions. Versions start at 1 and only grow.

A version's graph never changes once stored, so each catalogue keeps the graphs it has
read in memory: a run of the latest version costs one Redis read (which version is the
latest), a run of a given version none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.dsl.validate import validate_graph
from omniflow.errors import InvalidArgument, NotFound
from omniflow_services.coordinator.limits import RunLimits, check_graph

WORKFLOWS_KEY = "omniflow:workflows"
GRAPH_CACHE_SIZE = 256

# Store the graph, then move the summary forward only if this version is newer (two
# registrations racing must not leave the summary pointing at the older one).
_REGISTER = """
redis.call('SET', KEYS[2], ARGV[3])
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local latest = tonumber(cjson.decode(cur)['latest_version'])
  if latest >= tonumber(ARGV[2]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class WorkflowSummary:
    name: str
    latest_version: int
    description: str = ""


class WorkflowCatalogue:
    """Registered workflows, read from Redis."""

    def __init__(self, redis: aioredis.Redis, limits: RunLimits | None = None) -> None:
        self._redis = redis
        self.limits = limits or RunLimits()
        self._graphs: dict[tuple[str, int], cpb.WorkflowGraph] = {}
        self._latest: dict[str, int] = {}  # the latest version this catalogue has seen

    def _remember(self, graph: cpb.WorkflowGraph) -> None:
        if len(self._graphs) >= GRAPH_CACHE_SIZE:
            del self._graphs[next(iter(self._graphs))]  # the oldest entry
        self._graphs[(graph.name, graph.version)] = graph

    async def list(self) -> list[WorkflowSummary]:
        raw = await self._redis.hgetall(WORKFLOWS_KEY)
        out = []
        for value in raw.values():
            data = json.loads(value)
            out.append(
                WorkflowSummary(
                    data["name"], int(data["latest_version"]), data.get("description", "")
                )
            )
        return sorted(out, key=lambda w: w.name)

    async def register(self, graph: cpb.WorkflowGraph) -> int:
        """Validate and store ``graph`` as the next version of its name; returns it."""
        check_graph(self.limits, graph)  # before validation walks it
        validate_graph(graph)
        version = int(await self._redis.incr(f"omniflow:workflow:{graph.name}:seq"))
        stored = cpb.WorkflowGraph()
        stored.CopyFrom(graph)
        stored.version = version
        summary = json.dumps(
            {"name": graph.name, "latest_version": version, "description": graph.description}
        )
        key = f"omniflow:workflow:{graph.name}:{version}"
        await self._redis.eval(
            _REGISTER,
            2,
            WORKFLOWS_KEY,
            key,
            graph.name,
            version,
            stored.SerializeToString(),
            summary,
        )
        self._remember(stored)
        self._latest[graph.name] = max(version, self._latest.get(graph.name, 0))
        return version

    def guess(self, name: str) -> cpb.WorkflowGraph | None:
        """The latest version of ``name`` this catalogue has seen, if it has the graph: a
        guess to start work on while ``get`` checks with Redis."""
        version = self._latest.get(name)
        return None if version is None else self._graphs.get((name, version))

    async def get(self, name: str, version: int = 0) -> cpb.WorkflowGraph:
        """A registered graph (``version`` 0: the latest); raises NotFound naming it.

        The graph returned is shared: callers must not modify it."""
        if not name:
            raise InvalidArgument("a workflow name is required")
        if version == 0:
            raw = await self._redis.hget(WORKFLOWS_KEY, name)
            if raw is None:
                known = sorted(k.decode() for k in await self._redis.hkeys(WORKFLOWS_KEY))
                raise NotFound(
                    f"unknown workflow {name!r}; registered: {', '.join(known) or 'none'}"
                )
            version = int(json.loads(raw)["latest_version"])
            self._latest[name] = version
        graph = self._graphs.get((name, version))
        if graph is not None:
            return graph
        data = await self._redis.get(f"omniflow:workflow:{name}:{version}")
        if data is None:
            raise NotFound(f"workflow {name!r} has no version {version}")
        graph = cpb.WorkflowGraph()
        graph.ParseFromString(data)
        self._remember(graph)
        return graph
