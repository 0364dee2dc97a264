"""Fixtures shared by the whole test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omniflow.localredis import LocalRedisError, RedisProcess, find_redis_server, start_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A real redis-server on 127.0.0.1, shared by the session and stopped at its end.

    Tests share it: keep keys apart with a unique prefix per test (or flush only
    what you made). Skips, saying why, when no redis-server binary exists.
    """
    try:
        binary = find_redis_server()
    except LocalRedisError as exc:
        pytest.skip(f"needs a redis-server: {exc}")
    # A server that is present but fails to start is an error, not a skip.
    server = start_redis(dir=tmp_path_factory.mktemp("redis"), binary=binary)
    try:
        yield server
    finally:
        server.stop()
