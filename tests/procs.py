"""A service process started by a test (see the ``launch`` fixture in conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import time
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
