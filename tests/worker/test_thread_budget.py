"""The thread budget of a torch worker: explicit setting, OMP_NUM_THREADS, or a core share."""

from __future__ import annotations

import pytest

from omniflow_services.worker.engine.threads import node_cores, thread_budget


def test_an_explicit_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_budget(5, torch_workers=4, cores=16) == 5


def test_omp_num_threads_is_the_operators_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_budget(0, torch_workers=4, cores=16) == 3


@pytest.mark.parametrize(
    ("workers", "cores", "want"), [(1, 16, 16), (4, 16, 4), (5, 16, 3), (5, 2, 1), (3, 1, 1)]
)
def test_default_is_a_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, workers: int, cores: int, want: int
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thread_budget(0, torch_workers=workers, cores=cores) == want


def test_node_cores_is_at_least_one_and_at_most_the_affinity() -> None:
    import os

    assert 1 <= node_cores() <= len(os.sched_getaffinity(0))
