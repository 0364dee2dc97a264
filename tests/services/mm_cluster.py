"""A small multimodal cluster of real processes for the multimodal role tests.

kv-index, one kv-agent, and workers of every role (llm, encoder, diffusion, talker) on tiny
models, discovered through a private Redis. Every process is ended (SIGTERM, then SIGKILL)
and every shared-memory file of the agent removed at teardown.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from omniflow.localredis import RedisProcess, start_redis
from omniflow.models.resolve import resolve_model
from omniflow.testing.nodes import Nodes
from omniflow.wav import wav_bytes

MODELS = (
    "tiny:qwen2",
    "tiny:vision-encoder",
    "tiny:audio-encoder",
    "tiny:diffusion",
    "tiny:talker",
)


class Cluster(Nodes):
    """The processes of one node ("mm-node"): omniflow.testing.nodes' process handling, with
    instance ids that carry the cluster's tag (the agent's shared-memory files are named by
    it, so ``stop`` finds and removes them)."""

    def __init__(self, root: Path, redis: RedisProcess, models_dir: Path) -> None:
        env = {"OMNIFLOW_NODE_ID": "mm-node", "OMNIFLOW_MODELS_DIR": str(models_dir)}
        super().__init__(root, redis, base_env=env)
        self.models_dir = models_dir

    def start(self, module: str, name: str, **env: str) -> None:
        super().start(module, name, **{"OMNIFLOW_INSTANCE_ID": f"{name}-{self.tag}", **env})

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None


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
        c.stop()  # and the Redis


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
    return wav_bytes(samples.tobytes(), rate)
