"""The engine stops on every end-of-sequence id of generation_config.json, not only the
first: a greedy continuation is run once with eos ignored, then the first token it produced
is made the second eos id of the model, and the run stops there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine_helpers import run_all

from omniflow.chat import Preprocessor
from omniflow.models.resolve import resolve_model
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest, SamplingParams


def _run(folder: Path, prompt: list[int], ignore_eos: bool):
    eng = Engine(folder, EngineConfig(num_pages=32))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=ignore_eos)
    return eng, run_all(eng, [GenerateRequest("r", tuple(prompt), params=params)])["r"]


def test_every_eos_id_of_generation_config_stops(tmp_path: Path) -> None:
    src = resolve_model("tiny:qwen2", tmp_path / "models")
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    prompt = Preprocessor.from_folder(folder, bytes(16)).encode_chat(
        [{"role": "user", "content": "Tell me about the sea"}]
    )
    _, free = _run(folder, prompt, ignore_eos=True)
    toks = free.tokens
    k = 0  # (a random tiny model tends to repeat one token)
    later = toks[k]
    gen = json.loads((folder / "generation_config.json").read_text())
    first = gen["eos_token_id"][0] if isinstance(gen["eos_token_id"], list) else gen["eos_token_id"]
    assert first not in toks[: k + 1]
    gen["eos_token_id"] = [first, later]
    (folder / "generation_config.json").write_text(json.dumps(gen))

    eng, stopped = _run(folder, prompt, ignore_eos=False)
    assert eng.eos_token_ids == {first, later}
    assert stopped.tokens == toks[: k + 1]
    assert stopped.final.finish_reason == "stop"
    assert Preprocessor.from_folder(folder, bytes(16)).eos_token_ids == (first, later)
