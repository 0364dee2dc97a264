"""``omniflow up | status | down``: the whole topology as local processes on one machine.

State lives in a run folder (``.omniflow/run`` under the current directory, or
``OMNIFLOW_RUN_DIR``): ``state.json`` with every process started, ``logs/`` with one
log per service, ``ready/`` where each service writes its address once SERVING.
``down`` ends exactly the processes recorded there, by PID, after checking that each
PID still runs the command that was started. ``up`` starts a supervisor last
(``omniflow.cli.supervise``, its PID in ``state.json``) that restarts a process that
dies, with backoff; ``down`` ends the supervisor first. ``state.json`` is readable by its
owner only: it holds the Redis URL with the password of the Redis ``up`` started.

Every process runs with mutual TLS and auth (``omniflow.security.local``: a CA, a
certificate per process, tokens and gateway API keys under ``pki/``); ``up --insecure``
(or ``OMNIFLOW_UP_TLS=off``) runs plaintext, for development only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omniflow.config import local_settings
from omniflow.deploy.topology import Topology
from omniflow.localredis import redact_url, start_redis
from omniflow.rpc.client import check_health
from omniflow.security import local as local_security

STATE = local_security.STATE_FILE  # one name for up, down and the clients
SUPERVISOR = "omniflow.cli.supervise"
UMASK = 0o077  # of ``up`` and every process it starts: run-folder files 0600, folders 0700


@dataclass(slots=True)
class Proc:
    """One process ``up`` started."""

    name: str
    service: str
    pid: int
    log: str
    address: str = ""
    marker: str = ""  # a string its /proc/PID/cmdline must contain for ``down`` to end it
    argv: list[str] = field(default_factory=list)  # redis: its command line, to restart it
    env: dict[str, str] = field(default_factory=dict)  # what it was started with, over ours
    restarts: int = 0  # by the supervisor


def run_dir() -> Path:
    return Path(local_settings().run_dir).resolve()


def run_tag(folder: Path) -> str:
    """A short, stable identity of a run folder (its resolved path, device and inode)."""
    st = folder.stat()
    ident = f"{folder.resolve()}:{st.st_dev}:{st.st_ino}".encode()
    return hashlib.blake2b(ident, digest_size=5).hexdigest()


# Below this much free space in the run folder's file system the disk counts as full: the
# supervisor starts nothing (a process could not write its log or ready file) and
# ``status`` says so.
MIN_FREE_BYTES = 1 << 20


def disk_full(folder: Path) -> int | None:
    """The free bytes of ``folder``'s file system when it is full (below MIN_FREE_BYTES),
    else None."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return free if free < MIN_FREE_BYTES else None


def _alive(proc: Proc) -> bool:
    """Whether ``proc.pid`` still runs what ``up`` started (not a zombie, not a reused PID)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return False  # exited; its parent has not reaped it yet
    # An empty cmdline on a live process: it is between fork and exec (just started).
    return not cmdline or proc.marker in cmdline


def _load_state(folder: Path) -> tuple[list[Proc], dict[str, str]]:
    path = folder / STATE
    if not path.exists():
        return [], {}
    data = json.loads(path.read_text())
    return [Proc(**p) for p in data["procs"]], data.get("env", {})


def _supervisor(folder: Path) -> Proc | None:
    """The supervisor ``up`` started for this run folder, if recorded."""
    path = folder / STATE
    if not path.exists():
        return None
    pid = int(json.loads(path.read_text()).get("supervisor", 0))
    return Proc("supervisor", "supervisor", pid, "", marker=SUPERVISOR) if pid else None


def _save_state(
    folder: Path, procs: list[Proc], env: dict[str, str], supervisor: int | None = None
) -> None:
    if supervisor is None:  # keep the one recorded
        sup = _supervisor(folder)
        supervisor = sup.pid if sup is not None else 0
    data = {"procs": [asdict(p) for p in procs], "env": env, "supervisor": supervisor}
    tmp = folder / (STATE + f".{os.getpid()}.tmp")
    # 0600: the env holds the Redis URL with its password.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(data, indent=1))
    os.chmod(tmp, 0o600)  # an older file of this name may have had other bits
    tmp.replace(folder / STATE)


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _spawn(folder: Path, name: str, module: str, env: dict[str, str]) -> Proc:
    log = folder / "logs" / f"{name}.log"
    ready = folder / "ready" / f"{name}.json"
    ready.unlink(missing_ok=True)
    full_env = {
        **os.environ,
        **env,
        "OMNIFLOW_READY_FILE": str(ready),
        "OMNIFLOW_INSTANCE_ID": name,
    }
    target = module if "." in module else f"omniflow_services.{module}"
    # A worker may run from another virtualenv (the vLLM engine's: docs/vllm.md).
    python = full_env.get("OMNIFLOW_WORKER_PYTHON", "") if module == "worker" else ""
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        p = subprocess.Popen(
            [os.path.expanduser(python) if python else sys.executable, "-m", target],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the CLI; ended by `omniflow down`
            umask=UMASK,  # its ready file, its own files: 0600 (the supervisor's restarts too)
        )
    return Proc(name, module, p.pid, str(log), marker=target, env=env)


async def _wait_ready(folder: Path, proc: Proc, timeout_s: float) -> None:
    ready = folder / "ready" / f"{proc.name}.json"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not _alive(proc):
            raise RuntimeError(
                f"{proc.name} exited during start; log {proc.log}:\n{_tail(proc.log)}"
            )
        if ready.exists():
            info = json.loads(ready.read_text())
            proc.address = info.get("url") or info["address"]  # the gateway's is an HTTP URL
            if await _health(proc.address) == "SERVING":
                return
        await asyncio.sleep(0.1)
    raise RuntimeError(
        f"{proc.name} not SERVING after {timeout_s:.0f}s; log {proc.log}:\n{_tail(proc.log)}"
    )


def _plan(topology: Topology) -> list[tuple[str, str, dict[str, str]]]:
    """(name, module, extra env) of every service process, in start order."""
    plan: list[tuple[str, str, dict[str, str]]] = [
        ("kv-index", "kv_index", {}),
        ("kv-agent", "kv_agent", dict(topology.kv_agent_env)),
    ]
    for service, count in (("router", topology.routers), ("coordinator", topology.coordinators)):
        # The first keeps the plain name (``local_address("router")``); replicas are -2, -3...
        plan += [(service if i == 0 else f"{service}-{i + 1}", service, {}) for i in range(count)]
    # Every worker is a torch process: each gets its share of this node's cores.
    torch_workers = str(sum(spec.count for spec in topology.workers) or 1)
    for spec in topology.workers:
        for i in range(spec.count):
            env = {
                "OMNIFLOW_WORKER_ROLE": spec.role,
                "OMNIFLOW_NODE_TORCH_WORKERS": torch_workers,
                **spec.env,
            }
            if spec.model:
                env["OMNIFLOW_WORKER_MODEL"] = spec.model
            plan.append((f"{spec.role}-{i + 1}", spec.module, env))
    # The OpenAI HTTP API, once workers serve. Replicas (for a load balancer in front) on a
    # free port each, kept across restarts by the supervisor; ``status`` shows them.
    plan.append(("gateway", "gateway", {}))
    for i in range(1, topology.gateways):
        plan.append((f"gateway-{i + 1}", "gateway", {"OMNIFLOW_GATEWAY_PORT": "0"}))
    return plan


async def _health(address: str) -> str:
    """gRPC health of a service, or ``GET /health`` of one whose address is an HTTP URL."""
    if not address.startswith("http://"):
        return await check_health(address, timeout_s=1.0)

    def get() -> str:
        try:
            with urllib.request.urlopen(f"{address}/health", timeout=1.0) as reply:
                return "SERVING" if reply.status == 200 else "NOT_SERVING"
        except urllib.error.HTTPError:
            return "NOT_SERVING"
        except OSError:
            return "UNREACHABLE"

    return await asyncio.to_thread(get)


def print_table(procs: list[Proc], statuses: list[str]) -> None:
    rows = [("SERVICE", "MODULE", "ADDRESS", "PID", "RESTARTS", "STATUS")]
    rows += [
        (p.name, p.service, p.address or "-", str(p.pid), str(p.restarts), s)
        for p, s in zip(procs, statuses, strict=True)
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


async def _statuses(procs: list[Proc]) -> list[str]:
    async def one(p: Proc) -> str:
        if not _alive(p):
            return "EXITED"
        if not p.address:  # redis: alive is all we check
            return "RUNNING"
        return await _health(p.address)

    return list(await asyncio.gather(*(one(p) for p in procs)))


def secure_tree(folder: Path) -> None:
    """The run folder and every folder in it 0700, every file 0600: what an older run or a
    loose umask left there too (Redis's append-only file holds tenants' run inputs)."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        with contextlib.suppress(FileNotFoundError):  # a service's temporary file, gone
            path.chmod(0o700 if path.is_dir() else 0o600)


async def up(topology: Topology, start_timeout_s: float = 120.0, insecure: bool = False) -> int:
    """Start ``topology``; mutual TLS and auth unless ``insecure`` (or OMNIFLOW_UP_TLS=off).

    Whatever the caller's umask, the run folder is 0700 and what is made in it 0600: this
    process and every one it starts (they inherit it) run with umask 077."""
    old = os.umask(UMASK)
    try:
        return await _up(topology, start_timeout_s, insecure)
    finally:
        os.umask(old)


async def _up(topology: Topology, start_timeout_s: float, insecure: bool) -> int:
    folder = run_dir()
    secure = not insecure and local_security.enabled()
    procs, _ = _load_state(folder)
    sup = _supervisor(folder)
    if any(_alive(p) for p in procs) or (sup is not None and _alive(sup)):
        print(f"already running (run folder {folder}); `omniflow down` first", file=sys.stderr)
        print_table(procs, await _statuses(procs))
        return 1
    for sub in ("logs", "ready", "redis"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    secure_tree(folder)
    procs = []
    env = {
        "OMNIFLOW_DISCOVERY": "redis",
        "OMNIFLOW_NODE_ID": topology.node,
        # The agent's shared-memory names carry this run folder's identity: two topologies
        # on one machine (both with a "kv-agent") never map or delete each other's arena.
        "OMNIFLOW_KV_SHM_TAG": run_tag(folder),
    }
    try:
        redis_url = local_settings().redis_url
        if not redis_url:
            # Persistent (AOF, fsync every second) and with a password of this run folder.
            redis = start_redis(
                dir=folder / "redis", persist=True, password=secrets.token_urlsafe(24)
            )
            redis_url = redis.url
            procs.append(
                Proc(
                    "redis",
                    "redis-server",
                    redis.pid,
                    str(redis.log_path),
                    marker="redis-server",
                    argv=redis.argv,
                )
            )
            print(f"started redis-server (pid {redis.pid}) at {redact_url(redis_url)}")
        env["OMNIFLOW_REDIS_URL"] = redis_url
        plan = _plan(topology)
        pki = None
        if secure:  # mutual TLS and auth (docs/security.md)
            pki = local_security.prepare(folder, topology.node, [(n, m) for n, m, _ in plan])
            local_security.use_local_security(folder, starting=True)
        else:
            local_security.clear(folder)
            print("PLAINTEXT, no auth (--insecure / OMNIFLOW_UP_TLS=off): for development only")
        for name, module, extra in plan:
            secure = pki.env_for(name, module) if pki else {}
            proc = _spawn(folder, name, module, {**env, **extra, **secure})
            procs.append(proc)
            _save_state(folder, procs, env)
            print(f"starting {name} (pid {proc.pid}) ...", flush=True)
            await _wait_ready(folder, proc, start_timeout_s)
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        _save_state(folder, procs, env)
        stop_all(procs)
        (folder / STATE).unlink(missing_ok=True)
        return 1
    supervisor = 0
    if local_settings().supervise:
        supervisor = _start_supervisor(folder)
    _save_state(folder, procs, env, supervisor)
    print()
    print_table(procs, await _statuses(procs))
    if supervisor:
        print(f"supervisor pid {supervisor}: restarts a crashed process (with backoff)")
    if secure:
        client = folder / local_security.PKI_DIR / local_security.CLIENT_FILE
        print(
            f"\nmutual TLS and tokens on; client certificate, tokens and gateway API keys "
            f"(gateway_api_key) in {client}"
        )
    print(f"\nlogs: {folder / 'logs'}   stop: omniflow down")
    return 0


def _start_supervisor(folder: Path) -> int:
    log = folder / "logs" / "supervisor.log"
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR, str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=UMASK,  # what it restarts (Redis included) inherits it
        )
    return p.pid


def _stop_supervisor(folder: Path, grace_s: float = 10.0) -> bool:
    """End the supervisor first (nothing may restart while ``down`` stops); True if one ran."""
    sup = _supervisor(folder)
    if sup is None or not _alive(sup):
        return False
    os.kill(sup.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while _alive(sup) and time.monotonic() < end:
        time.sleep(0.05)
    if _alive(sup):
        os.kill(sup.pid, signal.SIGKILL)
    return True


def stop_all(procs: list[Proc], grace_s: float = 10.0) -> list[str]:
    """SIGTERM in reverse start order, then SIGKILL what outlives the grace period."""
    live = [p for p in reversed(procs) if _alive(p)]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        # Wait for each before the next: workers deregister while discovery still runs.
        end = time.monotonic() + grace_s
        while _alive(p) and time.monotonic() < end:
            time.sleep(0.05)
    killed = []
    for p in live:
        if _alive(p):
            os.kill(p.pid, signal.SIGKILL)
            killed.append(p.name)
    return killed


async def status() -> int:
    secured = local_security.use_local_security(run_dir())
    procs, _ = _load_state(run_dir())
    if not procs:
        print(f"nothing is running (no state in {run_dir()})")
        return 1
    statuses = await _statuses(procs)
    print_table(procs, statuses)
    print(f"security: {'mutual TLS + tokens' if secured else 'plaintext, no auth (--insecure)'}")
    sup = _supervisor(run_dir())
    if sup is not None:
        print(f"supervisor pid {sup.pid}: {'RUNNING' if _alive(sup) else 'EXITED'}")
    free = disk_full(run_dir())
    if free is not None:
        print(
            f"disk full: {free} bytes free for {run_dir()} (under {MIN_FREE_BYTES}); the "
            "supervisor restarts nothing until there is space, state.json may be stale"
        )
    return 0 if free is None and all(s in ("SERVING", "RUNNING") for s in statuses) else 1


def down() -> int:
    folder = run_dir()
    if _stop_supervisor(folder):
        print("stopped the supervisor")
    procs, _ = _load_state(folder)  # read after it stopped: the PIDs it restarted
    if not procs:
        local_security.clear(folder)
        print(f"nothing to stop (no state in {folder})")
        return 0
    killed = stop_all(procs)
    for p in procs:
        print(f"stopped {p.name} (pid {p.pid}){' with SIGKILL' if p.name in killed else ''}")
    (folder / STATE).unlink(missing_ok=True)
    local_security.clear(folder)  # its tokens and keys died with it
    return 0


def api_key(admin: bool = False) -> int:
    """``omniflow api-key``: print the gateway API key of the topology running from the run
    folder (tenant ``local``; ``admin``: the admin key), read from that topology, so that a
    key left by a stopped one is never handed out."""
    folder = run_dir()
    procs, _ = _load_state(folder)
    if not any(_alive(p) for p in procs):
        print(f"nothing is running (run folder {folder}): `omniflow up` first", file=sys.stderr)
        return 1
    record = local_security.client_record(folder)
    if not record:
        print("the topology runs plaintext (--insecure): the gateway takes no key",
              file=sys.stderr)  # fmt: skip
        return 1
    print(record["gateway_admin_key" if admin else "gateway_api_key"])
    return 0


def local_address(name: str) -> str | None:
    """The address of service ``name`` ("router", "coordinator", "llm-1", ...) of the
    running local topology, or None when it is not running. The caller becomes a client
    of that topology: it presents the run folder's certificate and admin token."""
    local_security.use_local_security(run_dir())
    procs, _ = _load_state(run_dir())
    for p in procs:
        if p.name == name and _alive(p):
            return p.address or None
    return None
