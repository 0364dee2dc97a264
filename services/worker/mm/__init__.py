"""Multimodal roles of the worker: encoders, image generation, speech (no gRPC here)."""
