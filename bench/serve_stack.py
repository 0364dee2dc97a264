"""The servers ``serve_openai.py`` measures, started and stopped by PID: the Omni-Flow
topology behind its gateway (one node, or several nodes with a kv-agent and an llm worker
each, sharing one kv-index), the echo TEST worker, and vLLM's own OpenAI servers.

Used by ``bench/serve_openai.py`` (the load generator); nothing here measures anything.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from omniflow.localredis import start_redis
from omniflow.testing.launch import Launcher

MODEL = "smollm2-135m-instruct"


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """Processes started by the bench, each in a session of its own (vLLM's engine processes
    end with their server), ended by PID (``omniflow.testing.launch``: SIGTERM, SIGKILL
    after 20 s, then what is left of the group)."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.launcher = Launcher(folder)

    def spawn(self, argv: list[str], name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self.launcher.spawn(argv, name, env, group=True).popen

    def service(
        self,
        module: str,
        name: str,
        env: dict[str, str],
        timeout_s: float = 300,
        python: str = sys.executable,
    ) -> dict:
        env = {"OMNIFLOW_LOG_LEVEL": "WARNING", "OMNIFLOW_NODE_ID": "bench", **env}
        proc = self.launcher.service(module, name, python=python, group=True, **env)
        try:
            proc.wait_ready(timeout_s)
        except AssertionError:
            raise RuntimeError(f"{name} did not start; see {proc.log}") from None
        return proc.info

    def stop(self) -> None:
        self.launcher.stop(timeout_s=20)
        self.launcher.started.clear()


@dataclass
class Omniflow:
    url: str
    worker: str  # the first worker's gRPC address
    router: str
    namespace: str
    base: dict[str, str]
    # The model name each node's worker serves (one node: the model's own name).
    models: dict[str, str] = field(default_factory=dict)


def vllm_import_path(folder: Path) -> dict[str, str]:
    """A ``PYTHONPATH`` under which vLLM's virtualenv imports omniflow from this checkout,
    whatever checkout its editable install names (one made in another folder points there,
    or at nothing): ``omniflow`` and ``omniflow_services`` linked in ``folder``."""
    root = Path(__file__).resolve().parents[1]
    folder.mkdir(exist_ok=True)
    for name, target in (
        ("omniflow", root / "libs/omniflow"),
        ("omniflow_services", root / "services"),
    ):
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(target)
    return {"PYTHONPATH": str(folder)}


def start_omniflow(
    procs: Procs,
    folder: Path,
    threads: int,
    engine: str = "torch",
    vllm_python: Path | None = None,
    nodes: tuple[str, ...] = ("bench",),
    llm_workers: int = 1,
) -> tuple[Omniflow, object]:
    """The topology behind the gateway; ``engine`` "vllm" hosts vLLM's engine in the worker
    (run from vLLM's own virtualenv, as ``OMNIFLOW_WORKER_PYTHON`` does in ``omniflow up``).

    With several ``nodes``, each node gets a kv-agent and one llm worker (``threads`` torch
    threads each) serving the model under a name of its own, ``<model>-<node>`` (a symlink
    to the same folder: same weights, same KV namespace), so that a client chooses the
    node of each request by the model it names while the KV cache stays shared. With one
    node, ``llm_workers`` llm workers serve the model under its own name (the router picks)."""
    redis = start_redis(dir=procs.dir / "redis")
    base = {"OMNIFLOW_REDIS_URL": redis.url, "OMNIFLOW_DISCOVERY": "redis"}
    index = procs.service("omniflow_services.kv_index", "kv-index", base)["address"]
    router = procs.service(
        "omniflow_services.router",
        "router",
        {
            **base,
            "OMNIFLOW_ROUTER_ROLE_STRATEGIES": "llm=kv_aware",
            "OMNIFLOW_KV_INDEX_ADDR": index,
        },
    )["address"]
    models_dir = procs.dir / "models"
    models_dir.mkdir(exist_ok=True)
    python = sys.executable
    extra: dict[str, str] = {}
    if engine == "vllm":
        if vllm_python is None or not vllm_python.exists():
            raise RuntimeError(f"--engine vllm needs vLLM's venv ({vllm_python}): run "
                               "scripts/setup_vllm_venv.sh")  # fmt: skip
        python = str(vllm_python)
        extra = {"OMNIFLOW_WORKER_ENGINE": "vllm", "VLLM_CPU_KVCACHE_SPACE": "2"}
        extra |= vllm_import_path(procs.dir / "pythonpath")
    workers: list[dict] = []
    models: dict[str, str] = {}
    for node in nodes:
        suffix = "" if len(nodes) == 1 else f"-{node}"
        agent = procs.service(
            "omniflow_services.kv_agent",
            f"kv-agent{suffix}",
            {
                **base,
                "OMNIFLOW_NODE_ID": node,
                "OMNIFLOW_KV_INDEX_ADDR": index,
                "OMNIFLOW_KV_HOST_BYTES": str(256 * 1024 * 1024),
                "OMNIFLOW_KV_SSD_PATH": str(procs.dir / f"ssd{suffix}.bin"),
                "OMNIFLOW_KV_SSD_BYTES": str(64 * 1024 * 1024),
            },
        )["address"]
        model = folder
        if suffix:
            model = models_dir / f"{MODEL}{suffix}"
            model.symlink_to(folder)
        models[node] = model.name if suffix else MODEL
        worker_env = {
            **base,
            **extra,
            "OMNIFLOW_NODE_ID": node,
            "OMNIFLOW_WORKER_ROLE": "llm",
            "OMNIFLOW_WORKER_MODEL": str(model),
            "OMNIFLOW_WORKER_DTYPE": "bfloat16",
            "OMNIFLOW_KV_AGENT_ADDR": agent,
            "OMNIFLOW_WORKER_TORCH_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
            # The nodes share this machine: a vLLM worker binds cores only when alone on it.
            "OMNIFLOW_NODE_TORCH_WORKERS": str(len(nodes) * llm_workers),
        }
        names = [f"llm{suffix}"] if suffix else [f"llm-{k + 1}" for k in range(llm_workers)]
        for name in names:
            workers.append(
                procs.service(
                    "omniflow_services.worker", name, worker_env, timeout_s=900, python=python
                )
            )
    # The echo worker's model ("echo") resolves to SmolLM2's folder in the gateway.
    echo = models_dir / "echo"
    if not echo.is_symlink():  # a second topology of the same run reuses it
        echo.symlink_to(folder)
    gw = procs.service(
        "omniflow_services.gateway",
        "gateway",
        {
            **base,
            "OMNIFLOW_GATEWAY_PORT": "0",
            "OMNIFLOW_ROUTER_ADDR": router,
            "OMNIFLOW_MODELS_DIR": str(models_dir),
        },
    )
    ns = workers[0]["metadata"]["kv_namespace"]
    other = {w["metadata"]["kv_namespace"] for w in workers} - {ns}
    if other:
        raise RuntimeError(f"the workers disagree on the KV namespace: {ns} and {other}")
    return Omniflow(gw["url"], workers[0]["address"], router, ns, base, models), redis


def start_echo(procs: Procs, of: Omniflow, name: str = "echo-1") -> Omniflow:
    """A worker of the echo TEST engine (answers at once) on the same topology, for the overhead."""
    echo = procs.service(
        "omniflow_services.worker",
        name,
        {
            **of.base,
            "OMNIFLOW_WORKER_ENGINE": "echo",
            "OMNIFLOW_WORKER_ROLE": "llm",
            "OMNIFLOW_ECHO_TOKEN_DELAY_MS": "0",
        },
    )
    time.sleep(1.5)  # the gateway's and router's discovery listings see it
    ns = echo["metadata"]["kv_namespace"]
    return Omniflow(of.url, echo["address"], of.router, ns, of.base)


def start_vllm(procs: Procs, folder: Path, python: Path, threads: int, name: str = "vllm") -> str:
    """vLLM's OpenAI server (prefix caching on) from its virtualenv; returns its URL."""
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": str(threads),
    }
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", MODEL, "--dtype", "bfloat16",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    proc = procs.spawn(argv, name, env)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 900
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited; see {procs.dir / (name + '.log')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM not up after 900 s; see {procs.dir / (name + '.log')}")


@dataclass
class Running:
    """One system under test of ``serve_openai.py``, up until its interleaved part ends."""

    name: str
    url: str
    procs: Procs
    redis: object | None = None
    of: Omniflow | None = None

    def stop(self) -> None:
        self.procs.stop()
        if self.redis is not None:
            self.redis.stop()  # type: ignore[attr-defined]
            self.redis = None


def start_system(
    name: str, root: Path, folder: Path, threads: int, vllm_python: Path | None
) -> Running:
    """``default`` (two llm workers, half the threads each, as ``omniflow up`` sizes them),
    ``one`` (one llm worker), ``vllm-engine`` (vLLM's engine in the worker) or ``vllm`` (vLLM's
    own server), in a run folder of its own under ``root``."""
    (root / name).mkdir()
    procs = Procs(root / name)
    try:
        if name == "vllm":
            assert vllm_python is not None
            return Running(name, start_vllm(procs, folder, vllm_python, threads), procs)
        workers, per_worker, engine = {
            "default": (2, max(1, threads // 2), "torch"),
            "one": (1, threads, "torch"),
            "vllm-engine": (1, threads, "vllm"),
        }[name]
        of, redis = start_omniflow(
            procs, folder, per_worker, engine, vllm_python, llm_workers=workers
        )
        return Running(name, of.url, procs, redis, of)
    except BaseException:
        procs.stop()
        raise
