"""The chaos test, short: a supervised local topology (echo TEST workers, real processes,
a Redis of its own) loses, in turn, an llm worker, the kv-agent, the router, the
coordinator, the kv-index and Redis to SIGKILL under load. No accepted run is lost or
left RUNNING, no output is wrong, and fresh requests succeed again within the 10 s
window with no manual step. ``bench/chaos.py`` is the longer version with the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniflow.testing.chaos import KILL_ORDER, chaos, table

pytestmark = pytest.mark.integration


@pytest.mark.timeout(280)
async def test_every_single_kill_heals_without_losing_a_run(
    tmp_path: Path, redis_binary: Path
) -> None:
    # redis_binary: skips, saying why, without a redis-server (chaos starts its own).
    result = await chaos(tmp_path, per_phase=8, window_s=10.0)
    phases, stuck = result.phases, result.stuck
    report = table(phases) + "\n" + "\n".join(f"{p.killed}: {n}" for p in phases for n in p.notes)
    assert [p.killed for p in phases] == list(KILL_ORDER)
    assert not stuck, f"runs left RUNNING: {stuck}\n{report}"
    assert not result.left_behind, f"omniflow down left processes: {result.left_behind}"
    for phase in phases:
        assert phase.total == 8, report
        assert phase.counts["lost"] == 0 and phase.counts["wrong"] == 0, report
        assert phase.recovery_s is not None, f"{phase.killed}: no recovery in 10 s\n{report}"
