"""The thread budget of a torch process: its share of the node's cores.

Several torch workers on one node each start an OpenMP pool as wide as the machine by
default; on a shared machine their threads spin against each other and one small matmul
can take ten times longer than on a single thread. Each worker therefore takes
``cores // torch workers on the node`` threads (at least 1), set before its first torch op.
An explicit ``OMP_NUM_THREADS`` in the environment counts as the operator's choice.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

_applied: int | None = None


def node_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota visible: affinity decides
    return max(1, cores)


def thread_budget(threads: int, torch_workers: int, cores: int | None = None) -> int:
    """``threads`` when set (> 0), else ``OMP_NUM_THREADS`` when set, else this node's cores
    divided among its torch workers (at least 1)."""
    if threads > 0:
        return threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (cores or node_cores()) // max(1, torch_workers))


def apply_thread_budget(threads: int) -> int:
    """Size torch's intra-op pool (and OpenMP/MKL) to ``threads``; idempotent per process.

    Call before the first torch op: torch allows setting the inter-op pool only once.
    """
    global _applied
    import torch

    if _applied == threads:
        return threads
    torch.set_num_threads(threads)
    if _applied is None:
        try:
            torch.set_num_interop_threads(1)  # the engine never runs ops in parallel itself
        except RuntimeError:  # some op already ran: the inter-op pool is fixed by now
            pass
    _applied = threads
    log.info("torch threads: %d", threads)
    return threads


class ThreadTuner:
    """Drops to one intra-op thread while the cores are shared, and comes back after.

    With N > 1 torch threads every op is a fork-join over N cores. When another process
    keeps one of those cores busy, each join waits for that core's next time slice: on this
    project's 2-core machine a two-thread decode step ran 10-30x slower than a one-thread
    step beside a spinning process. The tuner times the engine's steps (seconds per
    computed token) and, after ``every`` steps under the full budget (``first`` the first
    time), runs ``probe`` steps
    on one thread, compared with the ``probe`` steps just before them, all of them steps of
    the same number of tokens (a decode batch of one size; a probe that meets another kind
    of step is dropped and retried): when one thread is at least ``margin`` times faster the engine
    stays there, and probes the full budget again later, after twice as long each time the
    full budget loses (up to ``max_hold`` steps). A budget of one thread is never tuned.
    """

    def __init__(
        self,
        threads: int,
        every: int = 128,
        probe: int = 3,
        margin: float = 1.3,
        max_hold: int = 4096,
        first: int = 8,
    ) -> None:
        self.full = threads
        self.every, self.probe, self.margin, self.max_hold = every, probe, margin, max_hold
        self.current = threads
        self.switches = 0
        self._base = threads
        self._hold = min(first, every)  # the first probe comes early
        self._steps = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=probe)
        self._trial: list[tuple[float, int]] = []

    @property
    def active(self) -> bool:
        return self.full > 1

    def record(self, seconds: float, tokens: int) -> int:
        """Account one step; return the thread count the next step should run with."""
        if not self.active or tokens <= 0:
            return self.current
        if self.current != self._base:  # a probe step
            if tokens != self._recent[-1][1]:
                # another kind of step (a prefill among decodes, the batch changed): not
                # comparable; back to the baseline, and probe again at the next chance
                self.current = self._base
                self._recent.clear()
                return self.current
            self._trial.append((seconds, tokens))
            if len(self._trial) >= self.probe:
                self._decide()
            return self.current
        self._recent.append((seconds, tokens))
        self._steps += 1
        same = len({n for _, n in self._recent}) == 1
        if self._steps >= self._hold and len(self._recent) == self.probe and same:
            self.current = 1 if self._base == self.full else self.full
            self._trial = []
        return self.current

    def _decide(self) -> None:
        def per_token(steps: Iterable[tuple[float, int]]) -> float:
            steps = list(steps)
            return sum(t for t, _ in steps) / max(1, sum(n for _, n in steps))

        base, trial = per_token(self._recent), per_token(self._trial)
        one, full = (trial, base) if self.current == 1 else (base, trial)
        choose = 1 if one * self.margin < full else self.full
        if choose != self._base:
            self.switches += 1
            log.warning(
                "torch threads %d -> %d: %.3f ms a token on one thread, %.3f on %d%s",
                self._base,
                choose,
                1e3 * one,
                1e3 * full,
                self.full,
                " (the cores look shared with another process)" if choose == 1 else "",
            )
        self._hold = min(self._hold * 2, self.max_hold) if choose == 1 else self.every
        self._base = self.current = choose
        self._steps = 0
        self._recent.clear()
        self._trial = []
