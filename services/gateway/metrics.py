"""Prometheus series of the gateway (served at ``/metrics`` on its HTTP port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

REQUESTS = Counter(
    "omniflow_gateway_requests_total",
    "API requests answered, by route and status",
    ["route", "status"],
)
IN_FLIGHT = Gauge("omniflow_gateway_requests_in_flight", "API requests being served now")
TTFT = Histogram(
    "omniflow_gateway_time_to_first_token_seconds",
    "From request arrival to the first generated token",
    ["route"],
    buckets=_LATENCY,
)
ITL = Histogram(
    "omniflow_gateway_inter_token_latency_seconds",
    "Between two streamed chunks of one choice",
    ["route"],
    buckets=_ITL,
)
E2E = Histogram(
    "omniflow_gateway_request_duration_seconds",
    "From request arrival to the last byte of the answer",
    ["route"],
    buckets=_LATENCY,
)
PROMPT_TOKENS = Counter(
    "omniflow_gateway_prompt_tokens_total", "Prompt tokens of answered requests", ["route"]
)
CACHED_TOKENS = Counter(
    "omniflow_gateway_cached_prompt_tokens_total",
    "Prompt tokens whose KV the workers reused",
    ["route"],
)
COMPLETION_TOKENS = Counter(
    "omniflow_gateway_completion_tokens_total", "Generated tokens of answered requests", ["route"]
)
FIRST_AUDIO = Histogram(
    "omniflow_gateway_time_to_first_audio_seconds",
    "From request arrival to the first audio chunk sent (streamed spoken answers)",
    ["route"],
    buckets=_LATENCY,
)
AUDIO_SECONDS = Counter(
    "omniflow_gateway_audio_output_seconds_total",
    "Seconds of speech sent in answers (chat audio output and audio/speech)",
    ["route"],
)
AUDIO_INPUT_SECONDS = Counter(
    "omniflow_gateway_audio_input_seconds_total",
    "Seconds of audio heard (audio transcriptions and translations)",
    ["route"],
)
FAILOVERS = Counter(
    "omniflow_gateway_failovers_total",
    "Calls moved to another replica (or retried) after one did not answer, by service",
    ["service"],
)
RETRIES = Counter(
    "omniflow_gateway_worker_retries_total",
    "Generations started again on another worker after one failed, by when",
    ["when"],
)
REFUSED = Counter(
    "omniflow_gateway_tenant_refusals_total",
    "Requests refused because their tenant was past a fair-share limit, by limit",
    ["limit"],
)
