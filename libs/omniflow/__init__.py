"""Omni-Flow shared library: RPC runtime, discovery, telemetry, settings, KV and DSL."""

__version__ = "0.1.0"
