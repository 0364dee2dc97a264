"""Tiny models and their Hugging Face twins, shared by the engine tests (CPU, float32)."""

from __future__ import annotations

import pytest
from engine_helpers import MakeTiny, TinyModel, make_tiny_model


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory: pytest.TempPathFactory) -> MakeTiny:
    pytest.importorskip("transformers", reason="the reference model is transformers'")
    cache: dict[tuple, TinyModel] = {}

    def make(arch: str, **kw: object) -> TinyModel:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(out, arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest, tiny_factory: MakeTiny) -> TinyModel:
    """Llama (untied, sharded checkpoint) and Qwen2 (tied, QKV bias), 2 layers, hidden 64."""
    if request.param == "llama":
        return tiny_factory("llama", shards=2)
    return tiny_factory("qwen2")
