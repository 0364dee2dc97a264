"""The one process launcher (``omniflow.testing.launch``) on real child processes: each kind
of readiness, a process that exits first, SIGTERM then SIGKILL, and a process group ended
with its leader. Every process started here is ended by PID before the test returns."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from omniflow.testing.launch import Launcher, spawn, stop_all


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int) -> bool:
    """Whether ``pid`` (not our child) has ended: no such process, or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_ready_by_line_then_sigterm_ends_and_reaps(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    code = "import time; print('listening now', flush=True); time.sleep(600)"
    proc = launcher.spawn(_python(code), "liner", dict(os.environ))
    try:
        proc.wait_ready(30, line=r"listening \w+")
        assert proc.running()
    finally:
        launcher.stop()
    assert proc.popen.returncode == -signal.SIGTERM
    assert "listening now" in proc.tail()


def test_ready_by_port_and_by_ready_file(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(600)"
    )
    ready = tmp_path / "svc.ready.json"
    write = (
        "import json, sys, time; "
        f"open({str(ready)!r}, 'w').write(json.dumps({{'address': '127.0.0.1:9'}})); "
        "time.sleep(600)"
    )
    launcher = Launcher(tmp_path)
    try:
        launcher.spawn(_python(listen), "port", dict(os.environ)).wait_ready(30, port=port)
        svc = launcher.keep(spawn(_python(write), "svc", tmp_path, os.environ, ready_file=ready))
        assert svc.wait_ready(30).address == "127.0.0.1:9"
        assert svc.info == {"address": "127.0.0.1:9"}
        assert set(launcher.procs) == {"port", "svc"}
    finally:
        launcher.stop()
    assert all(p.popen.returncode is not None for p in launcher.started)


def test_a_process_that_exits_first_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    proc = spawn(_python("print('bad flag'); raise SystemExit(3)"), "early", tmp_path, os.environ)
    try:
        with pytest.raises(AssertionError, match=r"(?s)early exited 3.*bad flag"):
            proc.wait_ready(30, line="never printed")
    finally:
        stop_all([proc])


def test_sigterm_ignored_means_sigkill(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(600)"
    )
    proc = spawn(_python(code), "stubborn", tmp_path, os.environ)
    try:
        proc.wait_ready(30, line="up")
    finally:
        stop_all([proc], timeout_s=0.5)
    assert proc.popen.returncode == -signal.SIGKILL


def test_a_group_ends_with_its_leader(tmp_path: Path) -> None:
    # The leader starts a child that ignores SIGTERM (an engine process of a server).
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    leader = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print('child', p.pid, flush=True); time.sleep(600)"
    )
    proc = spawn(_python(leader), "leader", tmp_path, os.environ, group=True)
    grandchild = 0
    try:
        proc.wait_ready(30, line=r"child \d+")
        grandchild = int(proc.tail().split()[1])
        assert not _gone(grandchild)
    finally:
        stop_all([proc], timeout_s=10)
    assert proc.popen.returncode == -signal.SIGTERM
    end = time.monotonic() + 30  # the SIGKILLed grandchild is reaped by init meanwhile
    while not _gone(grandchild) and time.monotonic() < end:
        time.sleep(0.05)
    assert _gone(grandchild)
