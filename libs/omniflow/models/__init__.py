"""Small random-initialised models in the Hugging Face on-disk format (tests, benchmarks, demos)."""

from omniflow.models.tiny import make_tiny

__all__ = ["make_tiny"]
