"""A service process started by a test (see the ``launch`` fixture in conftest.py), and a
:class:`Launcher` that starts a topology's processes and ends them all."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path


@dataclasses.dataclass
class ServiceProc:
    name: str
    popen: subprocess.Popen[bytes]
    ready_file: Path
    log: Path
    address: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def info(self) -> dict:
        """What the service wrote to its ready file (address, service, instance id...)."""
        return json.loads(self.ready_file.read_text())

    def wait_ready(self, timeout_s: float = 30.0) -> ServiceProc:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.popen.returncode}:\n{self.tail()}")
            if self.ready_file.exists():
                self.address = self.info["address"]
                return self
            time.sleep(0.05)
        raise AssertionError(f"{self.name} not ready after {timeout_s}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no deregistration, no goodbye."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)


def start_service(module: str, name: str, *, tmp: Path, redis_url: str, **env: str) -> ServiceProc:
    """``python -m <module>`` on ``redis_url``'s discovery, port 0, no metrics port, its ready
    file and log in ``tmp`` (named after ``name``, also its instance id); ``env`` on top."""
    ready, log = tmp / f"{name}.ready.json", tmp / f"{name}.log"
    full_env = {
        **os.environ,
        "OMNIFLOW_REDIS_URL": redis_url,
        "OMNIFLOW_DISCOVERY": "redis",
        "OMNIFLOW_PORT": "0",
        "OMNIFLOW_METRICS_PORT": "-1",
        "OMNIFLOW_READY_FILE": str(ready),
        "OMNIFLOW_INSTANCE_ID": name,
        **env,
    }
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", module],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return ServiceProc(name, popen, ready, log)


def stop_all(procs: Iterable[ServiceProc], timeout_s: float = 10.0) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL past ``timeout_s``)."""
    procs = list(procs)
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


class Launcher:
    """Starts services into ``tmp`` on ``redis_url``'s discovery, each with ``defaults`` under
    its own env, and keeps them: :meth:`stop` ends them all, the last started first."""

    def __init__(self, tmp: Path, redis_url: str, **defaults: str) -> None:
        self.tmp, self.redis_url, self.defaults = tmp, redis_url, defaults
        self.started: list[ServiceProc] = []

    def __call__(self, module: str, name: str, **env: str) -> ServiceProc:
        env = {**self.defaults, **env}
        proc = start_service(module, name, tmp=self.tmp, redis_url=self.redis_url, **env)
        self.started.append(proc)
        return proc

    def gateway(
        self, api_key: str, router: ServiceProc, coordinator: ServiceProc, **env: str
    ) -> ServiceProc:
        """The gateway (HTTP on a free port, behind ``api_key``) over ``router`` and
        ``coordinator``, started and ready; ``env`` on top."""
        return self(
            "omniflow_services.gateway",
            "gateway",
            OMNIFLOW_GATEWAY_PORT="0",
            OMNIFLOW_GATEWAY_API_KEY=api_key,
            OMNIFLOW_ROUTER_ADDR=router.address,
            OMNIFLOW_COORDINATOR_ADDR=coordinator.address,
            **env,
        ).wait_ready()

    @property
    def procs(self) -> dict[str, ServiceProc]:
        """Every process started, by name."""
        return {p.name: p for p in self.started}

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_all(reversed(self.started), timeout_s)
