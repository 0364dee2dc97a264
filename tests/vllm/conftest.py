"""Fixtures of the vLLM backend tests (see vllm_cluster.py): skipped, saying why, without
vLLM's virtualenv, a redis-server or the model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_cluster import VLLMCluster, model_folder, vllm_ready
from vllm_server import VLLMServer

from omniflow.localredis import RedisProcess, start_redis


@pytest.fixture(scope="module")
def vllm_env(
    tmp_path_factory: pytest.TempPathFactory, redis_binary: Path
) -> Iterator[tuple[Path, RedisProcess]]:
    why = vllm_ready()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("vllm")
    model = model_folder(tmp)
    redis = start_redis(dir=tmp / "redis", binary=redis_binary)
    try:
        yield model, redis
    finally:
        redis.stop()
        shutil.rmtree(tmp / "redis", ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_cluster(vllm_env, tmp_path_factory) -> Iterator[VLLMCluster]:
    model, redis = vllm_env
    cluster = VLLMCluster(tmp_path_factory.mktemp("procs"), redis, model)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VLLMServer]:
    """vLLM's own OpenAI server on SmolLM2 (float32), the reference of parity tests; one per
    module. ``.post("completions", body)``, ``.base_url`` for the ``openai`` client."""
    why = vllm_ready()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("vllm-server")
    server = VLLMServer(model_folder(tmp), tmp)
    try:
        yield server.wait_ready()
    finally:
        server.stop()
