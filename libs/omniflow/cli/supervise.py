"""The supervisor of a local topology: restarts what ``omniflow up`` started when it dies.

``omniflow up`` starts it last (``python -m omniflow.cli.supervise RUN_DIR``) and records
its PID in ``state.json``; ``omniflow down`` ends it first, by that PID, so that nothing
is restarted while the topology stops. Every ``POLL_S`` it checks each recorded process
(by PID and command line, as ``down`` does); a dead one is started again with the same
command and environment, on the same port when it had one (its address stays valid for
clients that hold a channel; another port if that one is taken), after a backoff that
doubles per crash (``BACKOFF_S`` up to ``MAX_BACKOFF_S``) and resets once a process has
stayed up ``STABLE_S``. Redis restarts on its own port and data folder, so it loads its
append-only file back. Restarts are counted in ``state.json`` (``omniflow status`` shows
them); the supervisor's log is ``logs/supervisor.log``.

A port is kept whenever it is free (checked by binding it), however often the process
died; only a port another process took is given up. The supervisor's own record of the
processes is authoritative once read: when ``state.json`` cannot be written (a full disk)
it goes on from memory, says so in its log (once a minute), and writes the file once it
can — a restarted process is started once and counted once, never respawned on every
pass. A restart that cannot start (no space for its files) waits its backoff like a crash.
While the run folder's disk is full (``local.disk_full``) nothing is restarted at all (a
process could not write its log or ready file): the supervisor keeps running, says so
(its log, once a minute; ``omniflow status``) and restarts what is down once there is
space. Stopped while ``state.json`` is stale, it stops the processes the file does not
name itself, so that ``down`` leaves none behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from omniflow.backoff import Backoff
from omniflow.cli import local
from omniflow.localredis import spawn_redis

log = logging.getLogger("omniflow.supervisor")

POLL_S = 0.25
BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0
REPORT_EVERY_S = 60.0  # how often a state file that cannot be written is reported


@dataclass(slots=True)
class _Watch:
    """What the supervisor tracks of one process between polls."""

    started: float  # monotonic time of the last (re)start
    backoff: Backoff = field(default_factory=lambda: Backoff(BACKOFF_S, MAX_BACKOFF_S))
    backoff_s: float = 0.0  # the wait before its next restart (set from ``backoff``)
    down_since: float | None = None  # when it was first seen dead
    port_failures: int = 0  # restarts on the old port that died before serving

    def __post_init__(self) -> None:
        self.backoff_s = self.backoff.next() or BACKOFF_S


def _reap() -> None:
    """Collect the exit status of restarted children that died (no zombies left)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _port(address: str) -> str:
    if "//" in address:  # the gateway's HTTP URL
        return str(urlsplit(address).port or "")
    return address.rsplit(":", 1)[-1] if ":" in address else ""


def _port_free(address: str) -> bool:
    """Whether ``address``'s port can be bound again (as a gRPC server binds it)."""
    if "//" in address:
        address = urlsplit(address).netloc
    return _bindable(address)


def _bindable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "127.0.0.1", int(port)))
        except (OSError, ValueError):
            return False
    return True


class Supervisor:
    """Restarts the dead processes of one run folder (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stopping = False
        self._watch: dict[str, _Watch] = {}
        self._state: tuple[list[local.Proc], dict[str, str]] | None = None
        self._unsaved = False  # the last write of state.json failed: retried every pass
        self._reported = -REPORT_EVERY_S  # when an unwritable state file was last logged
        self._full_since: float | None = None  # when restarts began waiting for disk space
        self._reported_full = -REPORT_EVERY_S

    def _load(self) -> tuple[list[local.Proc], dict[str, str]]:
        # Read once: from then on this supervisor's record is the truth (it alone changes
        # the file while it runs), so a file it could not write costs no double restart.
        if self._state is None:
            self._state = local._load_state(self.folder)
        return self._state

    def _save(self, procs: list[local.Proc], env: dict[str, str]) -> None:
        try:
            local._save_state(self.folder, procs, env, supervisor=os.getpid())
        except OSError as exc:
            self._unsaved = True
            now = time.monotonic()
            if now - self._reported >= REPORT_EVERY_S:
                self._reported = now
                log.error("cannot write %s (%s; a full disk?): going on from memory, "
                          "written once it can be", self.folder / local.STATE, exc)  # fmt: skip
            return
        if self._unsaved:
            log.warning("%s written again", self.folder / local.STATE)
        self._unsaved = False

    def poll_once(self) -> int:
        """One pass: restart what is due; returns how many were restarted."""
        procs, env = self._load()
        now = time.monotonic()
        restarted = 0
        changed = False
        for proc in procs:
            watch = self._watch.setdefault(proc.name, _Watch(now))
            if local._alive(proc):
                if watch.down_since is None and now - watch.started > STABLE_S:
                    watch.backoff.reset()  # it stayed up: the next crash restarts fast
                    watch.backoff_s = watch.backoff.next() or BACKOFF_S
                changed |= self._note_ready(proc, watch)
                continue
            if watch.down_since is None:
                watch.down_since = now
                log.warning("%s (pid %s) is not running; restart in %.1f s",
                            proc.name, proc.pid, watch.backoff_s)  # fmt: skip
            if now - watch.down_since < watch.backoff_s or self.stopping:
                continue
            if now - watch.started < 5.0 and proc.address:
                watch.port_failures += 1  # died during its start: perhaps its port is taken
            free = local.disk_full(self.folder)
            if free is not None:  # it could not write its log or ready file: wait for space
                self._full_since = now if self._full_since is None else self._full_since
                if now - self._reported_full >= REPORT_EVERY_S:
                    self._reported_full = now
                    log.error(
                        "disk full: %d bytes free for %s; %s and any other restart wait "
                        "until there is space", free, self.folder, proc.name,
                    )  # fmt: skip
                continue
            if self._full_since is not None:
                log.warning("disk space again after %.0f s: restarting", now - self._full_since)
                self._full_since, self._reported_full = None, -REPORT_EVERY_S
            watch.backoff_s = watch.backoff.next() or MAX_BACKOFF_S
            try:
                self._restart(proc, env)
            except OSError as exc:  # no space for its log or ready file: wait, then retry
                log.error("cannot restart %s (%s); next try in %.1f s", proc.name, exc,
                          watch.backoff_s)  # fmt: skip
                watch.down_since = time.monotonic()
                continue
            watch.started, watch.down_since = time.monotonic(), None
            restarted += 1
            changed = True
        if changed or self._unsaved:
            self._save(procs, env)
        _reap()
        return restarted

    def _note_ready(self, proc: local.Proc, watch: _Watch) -> bool:
        """Record the address a restarted process reports once SERVING."""
        ready = self.folder / "ready" / f"{proc.name}.json"
        if not proc.service or proc.service == "redis-server" or not ready.exists():
            return False
        try:
            info = json.loads(ready.read_text())
        except (OSError, ValueError):
            return False  # being written
        if info.get("pid") != proc.pid:
            return False
        address = info.get("url") or info.get("address", "")
        watch.port_failures = 0
        if address and address != proc.address:
            proc.address = address
            return True
        return False

    def _restart(self, proc: local.Proc, env: dict[str, str]) -> None:
        old = proc.pid
        if proc.service == "redis-server":
            password = urlsplit(env.get("OMNIFLOW_REDIS_URL", "")).password or ""
            proc.pid = spawn_redis(proc.argv, Path(proc.log).parent, password).pid
        else:
            extra = dict(proc.env)
            port = _port(proc.address)
            # Its old port whenever it is free (clients hold channels to that address);
            # after starts that died twice, only if no other process took it meanwhile.
            if port and (self._watch[proc.name].port_failures < 2 or _port_free(proc.address)):
                http = "//" in proc.address  # the gateway: its HTTP port, however first chosen
                extra["OMNIFLOW_GATEWAY_PORT" if http else "OMNIFLOW_PORT"] = port
            proc.pid = local._spawn(self.folder, proc.name, proc.service, extra).pid
        proc.restarts += 1
        log.warning("restarted %s: pid %s -> %s (restart %d)", proc.name, old, proc.pid,
                    proc.restarts)  # fmt: skip

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("supervising %s (pid %s)", self.folder, os.getpid())
        while not self.stopping:
            try:
                self.poll_once()
            except Exception:  # a bad state file must not end supervision for good
                log.exception("supervision pass failed")
            time.sleep(POLL_S)
        log.info("supervisor stopping")
        self._stop_unrecorded()
        return 0

    def _stop_unrecorded(self, grace_s: float = 5.0) -> None:
        """``down`` stops the PIDs in ``state.json``: when the file could not be written,
        the processes restarted since are known here alone, so they are stopped here."""
        if self._state is None or not self._unsaved:
            return
        procs, env = self._state
        self._save(procs, env)  # one last try
        if not self._unsaved:
            return
        try:
            recorded = {p.pid for p in local._load_state(self.folder)[0]}
        except (OSError, ValueError):
            recorded = set()
        stray = [p for p in procs if p.pid not in recorded and local._alive(p)]
        for p in stray:
            log.warning("stopping %s (pid %s) myself: state.json does not name it", p.name, p.pid)
        local.stop_all(stray, grace_s)

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m omniflow.cli.supervise RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return Supervisor(Path(args[0]).resolve()).run()


if __name__ == "__main__":
    sys.exit(main())
