"""Idle services stay idle: every service process, started for real (the kv-agent with NIXL
where it imports), uses a small CPU-seconds budget over a quiet window once it is SERVING.

Not a timing assertion: CPU seconds from /proc/PID/stat, with a wide margin (a spinning
thread burns ~1 s per second; the budget is 0.2 s over ``WINDOW_S``, i.e. 2% of a core).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from omniflow.rpc.client import check_health
from omniflow_services.kv_agent.nixl_channel import nixl_unavailable_reason

WINDOW_S = 8.0
BUDGET_S = 0.02 * WINDOW_S  # under 2% of one core, each
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its threads (fields 14 and 15 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def _serving(address: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await check_health(address) == "SERVING":
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{address} not SERVING after {timeout_s}s")


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
async def test_every_service_is_idle_when_idle(launch, tmp_path: Path) -> None:
    nixl = nixl_unavailable_reason() is None
    shm = f"idle{os.getpid()}"
    procs = [launch("omniflow_services.kv_index", "kv-index").wait_ready()]
    procs.append(
        launch(
            "omniflow_services.kv_agent",
            "kv-agent",
            OMNIFLOW_KV_CHANNELS="grpc,nixl" if nixl else "grpc",
            OMNIFLOW_KV_SHM_TAG=shm,
            OMNIFLOW_KV_HOST_BYTES=str(8 * 1024 * 1024),
            OMNIFLOW_KV_SSD_PATH=str(tmp_path / "ssd.bin"),
            OMNIFLOW_KV_SSD_BYTES=str(8 * 1024 * 1024),
        ).wait_ready(60)
    )
    procs.append(launch("omniflow_services.router", "router").wait_ready())
    procs.append(launch("omniflow_services.coordinator", "coordinator").wait_ready())
    procs.append(
        launch(
            "omniflow_services.worker",
            "llm-1",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_WORKER_MODEL="tiny:qwen2",
            OMNIFLOW_MODELS_DIR=str(tmp_path / "models"),
            OMNIFLOW_WORKER_KV_BYTES=str(4 * 1024 * 1024),
            OMNIFLOW_NODE_TORCH_WORKERS="1",
        ).wait_ready(120)
    )
    for p in procs:
        await _serving(p.address)
    await asyncio.sleep(2.0)  # let start-up work (first registrations, warm-up) settle
    before = {p.name: cpu_seconds(p.pid) for p in procs}
    await asyncio.sleep(WINDOW_S)
    used = {p.name: cpu_seconds(p.pid) - before[p.name] for p in procs}
    over = {name: round(s, 3) for name, s in used.items() if s > BUDGET_S}
    assert not over, (
        f"over {BUDGET_S:.2f} CPU s in {WINDOW_S:.0f} s idle (nixl={'on' if nixl else 'off'}): "
        f"{over}; all: { {n: round(s, 3) for n, s in used.items()} }"
    )
