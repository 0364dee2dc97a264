"""The built-in PyTorch engine of the LLM worker (no gRPC here; see DESIGN.md §4.4)."""

from omniflow_services.worker.engine.config import EngineConfig, ModelConfig
from omniflow_services.worker.engine.connector import BlockEventSink, KVConnector, MemoryConnector
from omniflow_services.worker.engine.engine import Engine
from omniflow_services.worker.engine.sampling import SamplingParams
from omniflow_services.worker.engine.types import (
    EmbedSpan,
    EngineLoad,
    EngineStats,
    GenerateRequest,
    RequestOutput,
    Usage,
)

__all__ = [
    "BlockEventSink",
    "EmbedSpan",
    "Engine",
    "EngineConfig",
    "EngineLoad",
    "EngineStats",
    "GenerateRequest",
    "KVConnector",
    "MemoryConnector",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Usage",
]
