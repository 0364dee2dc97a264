"""The router's core: the table of live workers per role, and picking among them.

Fed by a discovery watch; no gRPC here.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

from omniflow.errors import InvalidArgument, NotFound, Unimplemented
from omniflow.workers import WorkerRecord

# Strategies built so far; the KV-aware and load-based ones come with the Control Flow issue.
STRATEGIES = ("round_robin", "random")


class WorkerTable:
    """Live workers by id, replaced wholesale on every discovery change."""

    def __init__(self, seed: int | None = None) -> None:
        self._workers: dict[str, WorkerRecord] = {}
        self._cursor: dict[str, itertools.count[int]] = {}
        self._rng = random.Random(seed)
        self.generation = 0

    def replace(self, workers: Iterable[WorkerRecord]) -> None:
        self._workers = {w.worker_id: w for w in workers}
        self.generation += 1

    def list(self, role: str = "") -> list[WorkerRecord]:
        found = [w for w in self._workers.values() if not role or w.role == role]
        return sorted(found, key=lambda w: w.worker_id)

    def roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self._workers.values():
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def pick(
        self, role: str, strategy: str, exclude: Iterable[str] = (), operation: str = ""
    ) -> WorkerRecord:
        """One worker of ``role``; raises NotFound when none is live."""
        if not role:
            raise InvalidArgument("role is required (e.g. 'llm', 'encoder', 'diffusion')")
        if strategy not in STRATEGIES:
            raise Unimplemented(
                f"strategy {strategy!r} is not available yet (needs the Control Flow router "
                f"strategies); available: {', '.join(STRATEGIES)}"
            )
        excluded = set(exclude)
        candidates = [
            w
            for w in self.list(role)
            if w.worker_id not in excluded and (not operation or operation in w.operations)
        ]
        if not candidates:
            live = ", ".join(sorted(self.roles())) or "none"
            raise NotFound(f"no live worker of role {role!r}; live roles: {live}")
        if strategy == "random":
            return self._rng.choice(candidates)
        cursor = self._cursor.setdefault(role, itertools.count())
        return candidates[next(cursor) % len(candidates)]
