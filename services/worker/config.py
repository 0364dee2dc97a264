"""Worker settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, setting

ROLES = ("llm", "encoder", "diffusion", "talker")


@dataclass(frozen=True, slots=True)
class WorkerSettings(CommonSettings):
    """Settings of a worker (plus the common ones)."""

    role: str = setting("OMNIFLOW_WORKER_ROLE", "llm", "role this worker serves", choices=ROLES)
    model: str = setting(
        "OMNIFLOW_WORKER_MODEL", "", "model folder (Hugging Face format); empty: no model loaded"
    )
    engine: str = setting(
        "OMNIFLOW_WORKER_ENGINE", "torch", "engine backend", choices=("torch", "sglang")
    )
    device: str = setting("OMNIFLOW_WORKER_DEVICE", "cpu", "torch device (cpu, cuda, cuda:1)")
    dtype: str = setting(
        "OMNIFLOW_WORKER_DTYPE", "float32", "weights and KV dtype", choices=("float32", "bfloat16")
    )
    kv_agent_addr: str = setting(
        "OMNIFLOW_KV_AGENT_ADDR", "", "this node's kv-agent; empty: found through discovery"
    )
