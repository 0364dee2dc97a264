"""The built-in PyTorch engine of the LLM worker (no gRPC here; see DESIGN.md §4.4).

It re-exports the engine and the llm interface types it takes and gives (``llm.types``);
no module of the package imports the package itself, so there is no import circle."""

from omniflow.sampling import SamplingParams
from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.engine.engine import Engine
from omniflow_services.worker.llm.connector import BlockEventSink, KVConnector, MemoryConnector
from omniflow_services.worker.llm.model_folder import ModelConfig
from omniflow_services.worker.llm.types import (
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
