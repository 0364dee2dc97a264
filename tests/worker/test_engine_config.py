"""config.json parsing: old and new rope fields, defaults, and rejected settings."""

from __future__ import annotations

import pytest

from omniflow.errors import InvalidArgument
from omniflow_services.worker.engine.config import EngineConfig
from omniflow_services.worker.llm.model_folder import ModelConfig

BASE = {
    "model_type": "qwen2",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_defaults_follow_transformers() -> None:
    cfg = ModelConfig.from_dict({**BASE, "eos_token_id": 7})
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    assert cfg.attention_bias  # qwen2 projects q, k, v with a bias
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == (7,)


def test_rope_parameters_of_newer_transformers() -> None:
    raw = {**BASE, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}


def test_legacy_type_key() -> None:
    cfg = ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "dynamic"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({**BASE, "model_type": "gpt2"}, "accepted: ['llama', 'qwen2']"),
        ({**BASE, "rope_scaling": {"rope_type": "longrope"}}, "rope type 'longrope'"),
        ({**BASE, "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_settings_are_named(raw: dict, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        ModelConfig.from_dict(raw)
    assert needle in str(info.value)


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(InvalidArgument, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(InvalidArgument, match="page_size"):
        EngineConfig(page_size=0)
