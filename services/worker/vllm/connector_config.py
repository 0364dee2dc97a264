"""The Omni-Flow connector's settings inside vLLM's ``kv_transfer_config``.

``transfer_config`` is what ``backend.VLLMRole`` hands vLLM; ``ConnectorConfig.from_extra``
is how the connector (``connector.py``, loaded by vLLM from ``MODULE_PATH``) reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniflow.errors import InvalidArgument
from omniflow.kv.blocking import agent_settings
from omniflow.kv.blocks import KVLayout

MODULE_PATH = "omniflow_services.worker.vllm.connector"
CLASS_NAME = "OmniflowConnector"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Our fields of ``kv_connector_extra_config``: the agent, the index and the layout."""

    agent_address: str
    index_address: str
    layout: KVLayout
    kv_format: str = "cpu-amx"  # pages.FORMATS: how vLLM's blocks map to pages
    timeout_s: float = 10.0
    save: bool = True
    load: bool = True
    load_async: bool = True  # a request waits for its pages apart; the batch steps on
    max_queued_saves: int = 64

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        agent, index, timeout = agent_settings(extra, "kv_connector_extra_config")
        try:
            layout = KVLayout(
                model_id=str(extra["model_id"]),
                num_layers=int(extra["num_layers"]),
                num_kv_heads=int(extra["num_kv_heads"]),
                head_dim=int(extra["head_dim"]),
                dtype=str(extra["dtype"]),
                page_size=int(extra.get("page_size", 16)),
            )
            kv_format = str(extra["kv_format"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"kv_connector_extra_config: {exc!r}; it needs model_id, num_layers, "
                "num_kv_heads, head_dim, dtype, kv_format (and optionally page_size, timeout_s)"
            ) from None
        return cls(
            agent_address=agent,
            index_address=index,
            layout=layout,
            kv_format=kv_format,
            timeout_s=timeout,
            save=bool(extra.get("save", True)),
            load=bool(extra.get("load", True)),
            load_async=bool(extra.get("load_async", True)),
        )


def transfer_config(
    agent_address: str, index_address: str, layout: KVLayout, kv_format: str
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for this connector: its ``kv_connector_extra_config``
    points the connector at the agent and names the layout (``ConnectorConfig.from_extra``)."""
    extra = {
        "kv_format": kv_format,
        "agent_address": agent_address,
        "index_address": index_address,
        "model_id": layout.model_id,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "page_size": layout.page_size,
    }
    return {
        "kv_connector": CLASS_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
