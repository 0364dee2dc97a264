"""The one process launcher of the tests and benches: start a command with its env and its
log file, wait until it is ready, stop it by PID, reap it.

    launcher = Launcher(folder, OMNIFLOW_REDIS_URL=redis.url)
    router = launcher.service("omniflow_services.router", "router").wait_ready()
    ...
    launcher.stop()  # the last started first

Ready means one of: its ready file exists (``OMNIFLOW_READY_FILE``: a service is SERVING
then, and its ``address`` is read from it), a line of its log matches a pattern, a TCP port
accepts connections, or a probe answers True. A process that exits first fails the wait
with its log's tail.

Stopping (:func:`stop_all`) sends SIGTERM to every process still running, waits for each
(SIGKILL after ``timeout_s``) without reaping it, then — for one started in a session of its
own (``group=True``: vLLM's servers and workers, whose engine processes are their
children) — SIGKILLs what is left of its process group while the leader is still unreaped
(its pid, and so the group id, cannot be reused meanwhile), and only then reaps it. Nothing
is found by name: only the PIDs started here are signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.05


@dataclass
class ServiceProc:
    """A process started here: its log, its ready file (services) and, once ready, the
    address it wrote there."""

    name: str
    popen: subprocess.Popen[bytes]
    ready_file: Path | None
    log: Path
    address: str = ""
    group: bool = False  # started in a session of its own: stopped with its process group

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def info(self) -> dict:
        """What the service wrote to its ready file (address, service, instance id...)."""
        if self.ready_file is None:
            raise ValueError(f"{self.name} has no ready file")
        return json.loads(self.ready_file.read_text())

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def wait_ready(
        self,
        timeout_s: float = 30.0,
        *,
        line: str | None = None,
        port: int | None = None,
        probe: Callable[[], bool] | None = None,
    ) -> ServiceProc:
        """Wait until it is ready (the ready file by default; else the first of ``line``, a
        regular expression searched in its log, ``port`` on 127.0.0.1, or ``probe()``)."""
        pattern = re.compile(line) if line is not None else None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.popen.returncode}:\n{self.tail()}")
            if self._ready(pattern, port, probe):
                return self
            time.sleep(POLL_S)
        raise AssertionError(f"{self.name} not ready after {timeout_s}s:\n{self.tail()}")

    def _ready(
        self, pattern: re.Pattern[str] | None, port: int | None, probe: Callable[[], bool] | None
    ) -> bool:
        if pattern is not None and pattern.search(self.tail(1 << 20)):
            return True
        if port is not None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return True
        if probe is not None and probe():
            return True
        if pattern is None and port is None and probe is None:
            if self.ready_file is not None and self.ready_file.exists():
                with contextlib.suppress(ValueError):  # written but not complete yet
                    self.address = str(self.info.get("address", ""))
                    return True
        return False

    def kill(self) -> None:
        """SIGKILL and reap: no deregistration, no goodbye."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_all([self], timeout_s)


def spawn(
    argv: list[str],
    name: str,
    folder: Path,
    env: Mapping[str, str],
    *,
    ready_file: Path | None = None,
    group: bool = False,
    cwd: Path | None = None,
) -> ServiceProc:
    """Start ``argv`` with exactly ``env``, stdout and stderr into ``folder/<name>.log``
    (stdin closed); ``group`` starts it in a session of its own."""
    log = folder / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=group,
        )
    return ServiceProc(name, popen, ready_file, log, group=group)


def service_env(folder: Path, name: str, redis_url: str = "", **env: str) -> dict[str, str]:
    """A service's env for a test: this process's, discovery on ``redis_url`` (when given),
    port 0, no metrics port, a ready file in ``folder``, ``name`` as its instance id;
    ``env`` on top."""
    full = {
        **os.environ,
        "OMNIFLOW_PORT": "0",
        "OMNIFLOW_METRICS_PORT": "-1",
        "OMNIFLOW_READY_FILE": str(folder / f"{name}.ready.json"),
        "OMNIFLOW_INSTANCE_ID": name,
    }
    if redis_url:
        full |= {"OMNIFLOW_REDIS_URL": redis_url, "OMNIFLOW_DISCOVERY": "redis"}
    return full | env


def start_service(
    module: str, name: str, *, tmp: Path, redis_url: str, python: str = sys.executable, **env: str
) -> ServiceProc:
    """``python -m <module>`` with :func:`service_env` (not waited for)."""
    full = service_env(tmp, name, redis_url, **env)
    ready = Path(full["OMNIFLOW_READY_FILE"])
    return spawn([python, "-m", module], name, tmp, full, ready_file=ready)


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _wait_exit(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not _exited(pid):
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_S)
    return True


def stop_all(procs: Iterable[ServiceProc], timeout_s: float = 10.0) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL past ``timeout_s``),
    end what is left of a group's processes, and reap; see the module docstring."""
    live = [p for p in procs if p.popen.returncode is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)  # not popen.send_signal: that may reap it
    for proc in live:
        if not _wait_exit(proc.pid, timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            _wait_exit(proc.pid, 60.0)
        if proc.group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait()


class Launcher:
    """Starts processes into ``folder``, services on ``redis_url``'s discovery with
    ``defaults`` under their own env, and keeps them: :meth:`stop` ends them all, the last
    started first."""

    def __init__(self, folder: Path, redis_url: str = "", **defaults: str) -> None:
        self.folder, self.redis_url, self.defaults = folder, redis_url, defaults
        self.started: list[ServiceProc] = []

    def __call__(self, module: str, name: str, **env: str) -> ServiceProc:
        """``python -m module`` as service ``name`` (not waited for)."""
        return self.service(module, name, **env)

    def service(
        self,
        module: str,
        name: str,
        *,
        python: str = sys.executable,
        group: bool = False,
        **env: str,
    ) -> ServiceProc:
        full = service_env(self.folder, name, self.redis_url, **{**self.defaults, **env})
        ready = Path(full["OMNIFLOW_READY_FILE"])
        argv = [python, "-m", module]
        return self.keep(spawn(argv, name, self.folder, full, ready_file=ready, group=group))

    def spawn(
        self,
        argv: list[str],
        name: str,
        env: Mapping[str, str],
        *,
        group: bool = False,
        cwd: Path | None = None,
    ) -> ServiceProc:
        """Any command, with exactly ``env``."""
        return self.keep(spawn(argv, name, self.folder, env, group=group, cwd=cwd))

    def keep(self, proc: ServiceProc) -> ServiceProc:
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
