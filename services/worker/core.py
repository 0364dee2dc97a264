"""The worker's core state as the control plane sees it: role, operations, load.

The engines (LLM, encoders, diffusion, talker) plug in here; this module has no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

# Operations each role serves once its engine is loaded.
ROLE_OPERATIONS: dict[str, tuple[str, ...]] = {
    "llm": ("generate",),
    "encoder": ("encode",),
    "diffusion": ("generate_image",),
    "talker": ("synthesize",),
}


@dataclass(frozen=True, slots=True)
class Load:
    """What the router weighs: queue depth and free KV pages."""

    running: int = 0
    waiting: int = 0
    free_pages: int = 0
    total_pages: int = 0
    tokens_per_second: float = 0.0


class WorkerCore:
    """A worker's role and (once loaded) engine."""

    def __init__(self, role: str, model: str = "") -> None:
        self.role = role
        self.model = model
        self.kv_namespace = ""

    @property
    def operations(self) -> tuple[str, ...]:
        return ROLE_OPERATIONS.get(self.role, ())

    def load(self) -> Load:
        # No engine is attached in this build: nothing runs, nothing waits.
        return Load()
