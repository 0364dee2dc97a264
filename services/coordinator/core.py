"""The coordinator's core: the workflow catalogue, kept in Redis so that every
coordinator replica (and a restarted one) sees the same workflows.

Key layout: ``omniflow:workflows`` is a hash of workflow name → JSON summary
``{"name", "latest_version", "description"}``; each version's graph lives under
``omniflow:workflow:{name}:{version}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

WORKFLOWS_KEY = "omniflow:workflows"


@dataclass(frozen=True, slots=True)
class WorkflowSummary:
    name: str
    latest_version: int
    description: str = ""


class WorkflowCatalogue:
    """Registered workflows, read from Redis."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

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
