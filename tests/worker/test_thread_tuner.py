"""The thread tuner's decisions on measured step times: it keeps the full budget while that
is faster, drops to one thread when one thread is clearly faster (cores shared with a busy
process), backs off its probes of the full budget while they lose, and returns when the
full budget is faster again."""

from __future__ import annotations

from omniflow_services.worker.engine.threads import ThreadTuner


def drive(tuner: ThreadTuner, steps: int, ms_per_token: dict[int, float]) -> list[int]:
    """Run ``steps`` steps of 32 tokens, each taking ``ms_per_token[threads]``."""
    used = []
    for _ in range(steps):
        used.append(tuner.current)
        tuner.record(ms_per_token[tuner.current] * 32 / 1e3, 32)
    return used


def test_quiet_cores_keep_the_full_budget_with_short_probes() -> None:
    tuner = ThreadTuner(2, every=16, probe=2)
    used = drive(tuner, 200, {2: 1.0, 1: 1.8})
    assert tuner.current == 2 and tuner.switches == 0
    assert used.count(1) <= 200 // 16 * 2  # only the probes ran on one thread


def test_a_shared_core_means_one_thread_until_the_full_budget_wins_again() -> None:
    tuner = ThreadTuner(2, every=16, probe=2, max_hold=64)
    drive(tuner, 40, {2: 20.0, 1: 1.8})  # a spinning neighbour: two threads collapse
    assert tuner.current == 1 and tuner.switches == 1
    used = drive(tuner, 300, {2: 20.0, 1: 1.8})
    # probes of two threads back off: 16, 32, 64, 64, ... steps apart, two steps each
    assert 4 <= used.count(2) <= 2 * (1 + 300 // 32)
    assert tuner.current == 1 and tuner.switches == 1
    drive(tuner, 200, {2: 1.0, 1: 1.8})  # the neighbour left
    assert tuner.current == 2 and tuner.switches == 2


def test_one_thread_budget_is_never_tuned() -> None:
    tuner = ThreadTuner(1)
    assert not tuner.active
    assert set(drive(tuner, 50, {1: 1.0})) == {1} and tuner.switches == 0


def test_probes_compare_only_steps_of_the_same_size() -> None:
    """A cheap-per-token prefill step during a probe must not pass for a faster count."""
    tuner = ThreadTuner(2, every=4, probe=2, first=4)
    decode = {2: 20.0, 1: 1.8}  # two threads collapsed beside a busy core
    for _ in range(4):
        tuner.record(decode[tuner.current] * 8 / 1e3, 8)
    assert tuner.current == 1  # probing one thread
    tuner.record(0.05, 2048)  # a prefill arrives: the probe is dropped
    assert tuner.current == 2 and tuner.switches == 0
    for _ in range(4):  # two baseline steps of 8 tokens again, then a whole probe
        tuner.record(decode[tuner.current] * 8 / 1e3, 8)
    assert tuner.current == 1 and tuner.switches == 1
