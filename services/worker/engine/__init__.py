"""The built-in PyTorch engine of the LLM worker (no gRPC here; see DESIGN.md §4.4).

It re-exports the engine, its config and the names its callers drive it with: the sampling
contract, a request and its output (``llm.types``), an in-memory KV connector. The rest of
the interface is imported from ``llm`` itself. No module of the package imports the
package, so there is no import circle."""

from omniflow.sampling import SamplingParams
from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.engine.engine import Engine
from omniflow_services.worker.llm.connector import MemoryConnector
from omniflow_services.worker.llm.types import EmbedSpan, GenerateRequest, RequestOutput

__all__ = [
    "EmbedSpan",
    "Engine",
    "EngineConfig",
    "GenerateRequest",
    "MemoryConnector",
    "RequestOutput",
    "SamplingParams",
]
