"""The chaos test with two routers and two coordinators, reduced (few requests): under a
mix of workflow runs (the Python client), direct generations (the router's proxy), OpenAI
completions and chat turns of the workflow model (the gateway, which fails over between
the replicas itself), killing any one process (llm worker, kv-agent, router, coordinator,
kv-index, Redis) loses no request and returns no wrong answer, and a fresh request of each
kind succeeds again within the 10 s window. The full table is ``bench/chaos.py
--replicas 2``."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniflow.testing.chaos import KILL_ORDER, chaos, table

pytestmark = pytest.mark.integration

TARGETS = KILL_ORDER  # llm-1, kv-agent, router, coordinator, kv-index, Redis


@pytest.mark.timeout(600)
async def test_one_kill_of_a_replicated_topology_loses_no_request(
    tmp_path: Path, redis_binary: Path
) -> None:
    # redis_binary: skips, saying why, without a redis-server (chaos starts its own).
    result = await chaos(tmp_path, per_phase=9, window_s=10.0, replicas=2, targets=TARGETS)
    phases, stuck = result.phases, result.stuck
    report = table(phases) + "\n" + "\n".join(f"{p.killed}: {n}" for p in phases for n in p.notes)
    assert [p.killed for p in phases] == list(TARGETS)
    assert not stuck, f"runs left RUNNING: {stuck}\n{report}"
    assert not result.left_behind, f"omniflow down left processes: {result.left_behind}"
    for phase in phases:
        assert phase.total == 9, report
        assert phase.counts["lost"] == 0 and phase.counts["wrong"] == 0, report
        assert phase.recovery_s is not None, f"{phase.killed}: no recovery in 10 s\n{report}"
