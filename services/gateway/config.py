"""Gateway settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.chat.tools import parse_tool_formats
from omniflow.config import SettingsError, peer_address, setting
from omniflow.routing.settings import PickSettings

# "router": the role's default strategy (OMNIFLOW_ROUTER_ROLE_STRATEGIES, else
# OMNIFLOW_ROUTER_STRATEGY), as the router would pick.
LLM_STRATEGIES = (
    "kv_aware",
    "round_robin",
    "least_outstanding",
    "power_of_two",
    "random",
    "router",
)


@dataclass(frozen=True, slots=True)
class GatewaySettings(PickSettings):
    """Settings of the OpenAI-compatible HTTP gateway (plus the pick policy's, which its
    in-process pick reads as the router does, and the common ones).

    The gateway binds ``OMNIFLOW_HOST`` like every service, on its own HTTP port
    (``OMNIFLOW_GATEWAY_PORT``); it serves ``/metrics`` on that port, so
    ``OMNIFLOW_METRICS_PORT`` does not apply to it.
    """

    http_port: int = setting(
        "OMNIFLOW_GATEWAY_PORT", 8000, "HTTP port of the OpenAI API; 0 picks a free one", minimum=0
    )
    api_key: str = setting(
        "OMNIFLOW_GATEWAY_API_KEY",
        "",
        "when set, requests need `Authorization: Bearer <key>`; empty: no key",
    )
    api_keys_file: str = setting(
        "OMNIFLOW_GATEWAY_API_KEYS_FILE",
        "",
        'JSON key table {"keys": [{"key", "tenant", "admin"}]}: each key acts for its tenant '
        "(runs, workflows, KV pages); requests need one of them (docs/security.md)",
    )
    max_body_bytes: int = setting(
        "OMNIFLOW_GATEWAY_MAX_BODY_BYTES",
        16 * 1024 * 1024,
        "largest request body; larger ones get 413",
        minimum=1,
    )
    max_in_flight: int = setting(
        "OMNIFLOW_GATEWAY_MAX_IN_FLIGHT",
        256,
        "API requests served at once; more get 429",
        minimum=1,
    )
    max_n: int = setting(
        "OMNIFLOW_GATEWAY_MAX_N", 8, "largest `n` (choices per request)", minimum=1
    )
    request_timeout_s: float = setting(
        "OMNIFLOW_GATEWAY_REQUEST_TIMEOUT_S",
        300.0,
        "deadline of a worker or workflow call made for one API request",
        minimum=0.001,
    )
    pick_timeout_s: float = setting(
        "OMNIFLOW_GATEWAY_PICK_TIMEOUT_S",
        2.0,
        "deadline of the coordinator calls that list workflows and read a workflow's graph",
        minimum=0.001,
    )
    llm_strategy: str = setting(
        "OMNIFLOW_GATEWAY_LLM_STRATEGY",
        "kv_aware",
        "routing strategy of llm calls, picked in the gateway's process (router: the role's "
        "default, OMNIFLOW_ROUTER_ROLE_STRATEGIES / OMNIFLOW_ROUTER_STRATEGY)",
        choices=LLM_STRATEGIES,
    )
    max_prompt_bytes: int = setting(
        "OMNIFLOW_GATEWAY_MAX_PROMPT_BYTES",
        1 << 20,
        "largest prompt, refused (400) before it is templated or tokenized: text as UTF-8 "
        "bytes (chat: the messages' text), token ids as 4 bytes each",
        minimum=1,
    )
    max_header_bytes: int = setting(
        "OMNIFLOW_GATEWAY_MAX_HEADER_BYTES",
        32 * 1024,
        "largest request line and headers together; larger ones get 431 before any is read",
        minimum=1024,
    )
    header_timeout_s: float = setting(
        "OMNIFLOW_GATEWAY_HEADER_TIMEOUT_S",
        10.0,
        "a connection's request line and headers must arrive within this (from its first "
        "byte, or from its opening); else 408 and it is closed (slowloris)",
        minimum=0.1,
    )
    body_timeout_s: float = setting(
        "OMNIFLOW_GATEWAY_BODY_TIMEOUT_S",
        30.0,
        "a request's whole body must arrive within this after its headers; else 408 and the "
        "connection is closed",
        minimum=0.1,
    )
    idle_timeout_s: float = setting(
        "OMNIFLOW_GATEWAY_IDLE_TIMEOUT_S",
        5.0,
        "how long a kept-alive connection may wait for its next request",
        minimum=0.1,
    )
    max_connections: int = setting(
        "OMNIFLOW_GATEWAY_MAX_CONNECTIONS",
        1024,
        "connections and requests open at once; past it new ones get 503",
        minimum=1,
    )
    tenant_max_in_flight: int = setting(
        "OMNIFLOW_GATEWAY_TENANT_MAX_IN_FLIGHT",
        64,
        "API requests one tenant (an API key's) may have in flight; more get 429 naming this "
        "limit, other tenants are not affected; 0: only OMNIFLOW_GATEWAY_MAX_IN_FLIGHT",
        minimum=0,
    )
    tenant_tokens_per_minute: int = setting(
        "OMNIFLOW_GATEWAY_TENANT_TOKENS_PER_MINUTE",
        0,
        "prompt and generated tokens one tenant may use in a sliding minute; past it its new "
        "requests get 429 naming this limit; 0: no limit",
        minimum=0,
    )
    failover_wait_s: float = setting(
        "OMNIFLOW_GATEWAY_FAILOVER_WAIT_S",
        10.0,
        "how long a request waits for a coordinator replica to answer (every one is tried, "
        "then tried again with backoff), or for a live worker of its model, before its 503",
        minimum=0,
    )
    coordinator_addr: str = peer_address("OMNIFLOW_COORDINATOR_ADDR", "coordinator address")
    models_dir: str = setting(
        "OMNIFLOW_MODELS_DIR",
        "~/.cache/omniflow/models",
        "where the gateway looks for a worker's model folder (by name) when the worker's "
        "registered path does not exist here",
    )
    catalog_ttl_s: float = setting(
        "OMNIFLOW_GATEWAY_CATALOG_TTL_S",
        1.0,
        "how long a discovery listing of workers and workflows is reused",
        minimum=0,
    )
    tool_formats: str = setting(
        "OMNIFLOW_GATEWAY_TOOL_FORMATS",
        "*=hermes",
        "tool calling per model, `model=format` pairs (`*`: every other model): `hermes` (the "
        "template's own tools, else the hermes tool prompt; calls parsed from `<tool_call>` "
        "tags) or `none` (tools refused); docs/gateway.md",
    )

    def __post_init__(self) -> None:
        try:
            parse_tool_formats(self.tool_formats)
        except ValueError as exc:
            raise SettingsError(f"OMNIFLOW_GATEWAY_TOOL_FORMATS: {exc}") from None
