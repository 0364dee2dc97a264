"""The llm role over the built-in engine (``role.LLMRole``)."""

from omniflow_services.worker.llm.role import LLMRole

__all__ = ["LLMRole"]
