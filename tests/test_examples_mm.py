"""The multimodal examples run against `omniflow up` and write their outputs to files."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = """\
node: mm-examples
workers:
  - {role: llm, count: 1, model: "tiny:qwen2"}
  - {role: encoder, count: 1, model: "tiny:vision-encoder,tiny:audio-encoder"}
  - {role: diffusion, count: 1, model: "tiny:diffusion"}
  - {role: talker, count: 1, model: "tiny:talker"}
"""


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = [sys.executable, "-m", "omniflow.cli.main"]
    return subprocess.run([*exe, *args], env=env, capture_output=True, text=True, timeout=300)


def _example(name: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = ROOT / "examples" / name
    return subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.usefixtures("redis_binary")
def test_omni_turn_and_prompt_to_png_examples(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="the multimodal roles need Pillow (the worker extra)")
    from PIL import Image

    env = {
        **os.environ,
        "OMNIFLOW_RUN_DIR": str(tmp_path / "run"),
        "OMNIFLOW_MODELS_DIR": str(tmp_path / "models"),
    }
    env.pop("OMNIFLOW_REDIS_URL", None)
    topology = tmp_path / "topology.yaml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "out"
    try:
        up = _cli(["up", "--topology", str(topology)], env)
        assert up.returncode == 0, up.stdout + up.stderr
        turn = _example("omni_turn.py", ["--out", str(out), "--turns", "2"], env)
        assert turn.returncode == 0, turn.stdout + turn.stderr
        assert "cache hits 1" in turn.stderr  # the second turn's image came from the cache
        assert (out / "answer.txt").read_text()
        with wave.open(str(out / "answer.wav")) as wf:
            assert wf.getframerate() == 16000 and wf.getnframes() > 0
        png = _example(
            "prompt_to_png.py",
            ["a boat on a lake", "--out", str(out / "boat.png"), "--steps", "3", "--repeat", "2"],
            env,
        )
        assert png.returncode == 0, png.stdout + png.stderr
        assert "(16 cached), run 2" in png.stderr
        with Image.open(out / "boat.png") as img:
            assert img.size == (64, 64)
        via = _example(
            "prompt_to_png.py",
            ["a tree", "--via-llm", "--out", str(out / "tree.png"), "--steps", "2"],
            env,
        )
        assert via.returncode == 0, via.stdout + via.stderr
        assert "prefilled" in via.stderr
        with Image.open(io.BytesIO((out / "tree.png").read_bytes())) as img:
            assert img.format == "PNG"
    finally:
        down = _cli(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr
