"""The echo engine: a TEST llm engine of the worker (``OMNIFLOW_WORKER_ENGINE=echo``).

No model and no torch: it streams ``"echo: <prompt>"`` word by word from a fake
continuous-batching engine (``engine``), behind the worker's own edge, for the tests,
benches and examples that need many workers and no compute (docs/engine.md)."""
