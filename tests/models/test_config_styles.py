"""The engine reads a config written by transformers 5 (``rope_parameters``/``dtype``) and a
hub-style one (``rope_theta``/``rope_scaling``/``torch_dtype``) the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from smol_helpers import Smol, run_to_end

from omniflow_services.worker.llm.model_folder import ModelConfig


def _transformers5_folder(smol: Smol, out: Path, rope_scaling: dict | None) -> Path:
    """The converted folder with its config re-saved by transformers itself."""
    import transformers

    out.mkdir()
    for f in smol.converted.iterdir():
        if f.name != "config.json":
            os.symlink(f, out / f.name)
    config = transformers.AutoConfig.from_pretrained(smol.converted)
    if rope_scaling is not None:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling}
    config.save_pretrained(out)
    return out


def _hub_style(smol: Smol, rope_scaling: dict | None) -> dict:
    raw = json.loads((smol.converted / "config.json").read_text())
    assert "rope_theta" in raw and "torch_dtype" in raw and "rope_parameters" not in raw
    return {**raw, "rope_scaling": rope_scaling}


@pytest.mark.parametrize(
    "rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}], ids=["default", "linear"]
)
def test_both_styles_give_one_config(smol: Smol, tmp_path: Path, rope_scaling: dict | None) -> None:
    pytest.importorskip("transformers", reason="the transformers-5 style is written by it")
    folder = _transformers5_folder(smol, tmp_path / "t5", rope_scaling)
    new = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in new and "dtype" in new
    assert "rope_theta" not in new and "torch_dtype" not in new
    a = ModelConfig.from_dict(new)
    b = ModelConfig.from_dict(_hub_style(smol, rope_scaling))
    assert a.rope_theta == b.rope_theta == 100000.0
    assert a.checkpoint_dtype == b.checkpoint_dtype == "float32"
    if rope_scaling is None:
        assert a.rope_scaling is None and b.rope_scaling is None
    else:
        assert a.rope_scaling is not None and b.rope_scaling is not None
        assert a.rope_scaling["rope_type"] == b.rope_scaling["rope_type"] == "linear"
        assert a.rope_scaling["factor"] == b.rope_scaling["factor"] == 2.0
    assert (a.num_layers, a.num_kv_heads, a.head_dim, a.eos_token_ids) == (
        b.num_layers,
        b.num_kv_heads,
        b.head_dim,
        b.eos_token_ids,
    )


def test_engine_runs_the_same_on_both_styles(smol: Smol, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the transformers-5 style is written by it")
    from omniflow_services.worker.engine import (
        Engine,
        EngineConfig,
        GenerateRequest,
        SamplingParams,
    )

    folder = _transformers5_folder(smol, tmp_path / "t5", None)
    prompt = (1, 4093, 198, 19556, 905, 2, 198, 1, 520, 9531, 198)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = []
    for path in (smol.converted, folder):
        engine = Engine(path, EngineConfig(num_pages=8))
        results.append(
            run_to_end(engine, GenerateRequest("a", prompt, params=params, return_logits=True))
        )
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)
