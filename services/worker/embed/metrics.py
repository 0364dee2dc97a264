"""Prometheus series of the embed role: inputs and tokens embedded, forward sizes and times
(how well the batcher fills a forward: ``rate(..._batch_inputs_sum) / rate(..._count)``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

EMBEDDED = Counter("omniflow_worker_embed_inputs_total", "Inputs embedded")
TOKENS = Counter("omniflow_worker_embed_tokens_total", "Tokens of the inputs embedded")
BATCH = Histogram(
    "omniflow_worker_embed_batch_inputs",
    "Inputs in one encoder forward",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
FORWARD = Histogram(
    "omniflow_worker_embed_forward_seconds",
    "Time of one encoder forward over a batch",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
