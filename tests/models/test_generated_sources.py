"""Sources generated over the SmolLM2 backbone: the diffusion head and the encoders project
into its hidden size, and the diffusion role loads on the very folder the llm role serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniflow.models.resolve import resolve_model
from omniflow.models.sources import pull


def test_diffusion_head_names_the_pulled_backbone(pulled_models: Path) -> None:
    from omniflow_services.worker.mm.loading import backbone_of

    head = pull("smollm2-135m-diffusion", pulled_models, progress=lambda _: None)
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["model_type"] == "omniflow_image_head"
    assert backbone_of(head) == "smollm2-135m-instruct"
    assert (
        resolve_model(backbone_of(head), pulled_models) == pulled_models / "smollm2-135m-instruct"
    )


@pytest.mark.parametrize("kind", ["vision", "audio"])
def test_encoders_project_into_the_backbone_hidden_size(pulled_models: Path, kind: str) -> None:
    from omniflow_services.worker.mm.encoders import load_encoder

    folder = pull(f"smollm2-135m-{kind}-encoder", pulled_models, progress=lambda _: None)
    hidden = json.loads((pulled_models / "smollm2-135m-instruct" / "config.json").read_text())
    assert load_encoder(folder).out_hidden == hidden["hidden_size"] == 576


async def test_diffusion_role_runs_on_the_smollm2_backbone(pulled_models: Path) -> None:
    from omniflow_services.worker.engine import EngineConfig
    from omniflow_services.worker.mm.image_role import ImageRequest
    from omniflow_services.worker.mm.loading import load_roles

    roles = await load_roles(
        "diffusion", "smollm2-135m-diffusion", pulled_models, EngineConfig(num_pages=16)
    )
    assert roles.llm is not None and roles.diffusion is not None
    assert roles.llm.engine.model_config.hidden_size == 576
    assert roles.diffusion.head.model is roles.llm.engine.model  # one set of weights
    tok = roles.llm.engine.tokenizer
    ids = tok.encode("<|im_start|>user\na red square<|im_end|>\n").ids
    res = await roles.diffusion.generate(
        ImageRequest("img", ids, ids[:2], width=32, height=32, steps=2, guidance=1.0, seed=0)
    )
    assert res.png.startswith(b"\x89PNG") and (res.width, res.height) == (32, 32)
    again = await roles.diffusion.generate(
        ImageRequest("img2", ids, ids[:2], width=32, height=32, steps=2, guidance=1.0, seed=0)
    )
    assert again.png == res.png  # same seed, same image
