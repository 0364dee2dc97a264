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
