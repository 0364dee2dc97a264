"""A small multimodal cluster of real processes for the multimodal role tests.

kv-index, one kv-agent, and workers of every role (llm, encoder, diffusion, talker) on tiny
models, discovered through a private Redis. Every process is ended (SIGTERM, then SIGKILL)
and every shared-memory file of the agent removed at teardown.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omniflow.localredis import RedisProcess, start_redis
from omniflow.models.resolve import resolve_model

SHM = Path("/dev/shm")
MODELS = (
    "tiny:qwen2",
    "tiny:vision-encoder",
    "tiny:audio-encoder",
    "tiny:diffusion",
    "tiny:talker",
)


@dataclass
class Cluster:
    root: Path
    redis: RedisProcess
    models_dir: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def start(self, module: str, name: str, **env: str) -> None:
        ready = self.root / f"{name}.ready.json"
        log = self.root / f"{name}.log"
        full = {
            **os.environ,
            "OMNIFLOW_REDIS_URL": self.redis.url,
            "OMNIFLOW_DISCOVERY": "redis",
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": f"{name}-{self.tag}",
            "OMNIFLOW_NODE_ID": "mm-node",
            "OMNIFLOW_MODELS_DIR": str(self.models_dir),
            **env,
        }
        with open(log, "wb") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"omniflow_services.{module}"],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def wait(self, name: str, timeout_s: float = 120.0) -> str:
        ready = self.root / f"{name}.ready.json"
        end = time.monotonic() + timeout_s
        proc = self.procs[name]
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            if ready.exists():
                self.addresses[name] = json.loads(ready.read_text())["address"]
                return self.addresses[name]
            time.sleep(0.05)
        raise AssertionError(f"{name} not ready after {timeout_s}s:\n{self.log(name)}")

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for path in SHM.glob(f"omniflow-*{self.tag}*"):
            path.unlink(missing_ok=True)


def make_models(models_dir: Path) -> None:
    for spec in MODELS:
        resolve_model(spec, models_dir)


def start_cluster(root: Path, models_dir: Path, roles: tuple[str, ...]) -> Iterator[Cluster]:
    """Start index, agent and one worker per role in ``roles``; yields, then ends them."""
    redis = start_redis(dir=root / "redis")
    c = Cluster(root, redis, models_dir)
    try:
        c.start("kv_index", "kv-index")
        index = c.wait("kv-index")
        c.start("kv_agent", "kv-agent", OMNIFLOW_KV_INDEX_ADDR=index,
                OMNIFLOW_KV_HOST_BYTES=str(64 * 1024 * 1024),
                OMNIFLOW_KV_SSD_PATH=str(root / "ssd.bin"),
                OMNIFLOW_KV_SSD_BYTES=str(16 * 1024 * 1024))  # fmt: skip
        agent = c.wait("kv-agent")
        models = {
            "llm": "tiny:qwen2",
            "encoder": "tiny:vision-encoder,tiny:audio-encoder",
            "diffusion": "tiny:diffusion",
            "talker": "tiny:talker",
        }
        for role in roles:
            c.start("worker", role, OMNIFLOW_WORKER_ROLE=role, OMNIFLOW_WORKER_MODEL=models[role],
                    OMNIFLOW_KV_AGENT_ADDR=agent,
                    OMNIFLOW_WORKER_KV_BYTES=str(16 * 1024 * 1024))  # fmt: skip
        for role in roles:
            c.wait(role)
        yield c
    finally:
        c.stop()
        redis.stop()


def png(width: int, height: int, seed: int = 0, pixel: tuple[int, int] | None = None) -> bytes:
    """A random RGB PNG; ``pixel`` flips one pixel's red channel."""
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    if pixel is not None:
        arr[pixel[1], pixel[0], 0] ^= 0x01
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "PNG")
    return buf.getvalue()


def wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(rate)
        wf.writeframes(samples.tobytes())
    return buf.getvalue()
