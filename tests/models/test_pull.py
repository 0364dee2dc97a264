"""``omniflow models pull``: one folder in the cache however many processes pull at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniflow.errors import InvalidArgument
from omniflow.models import resolve
from omniflow.models.sources import SOURCES, get_source, pull

NAME = "smollm2-135m-instruct"


PULL = [sys.executable, "-m", "omniflow.cli.main", "models", "pull", NAME]


def _spawn(models_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*PULL, "--models-dir", str(models_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_concurrent_pulls_build_one_folder_and_repeat_is_a_no_op(
    smol_gguf: Path, tmp_path: Path
) -> None:
    procs = [_spawn(tmp_path) for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    outs = [out.strip() for out, _ in results]
    assert outs == [str(tmp_path / NAME)] * 2
    # Exactly one of them converted; the other waited on the lock and reused the folder.
    assert sum("dequantized" in err for _, err in results) == 1
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert visible == [NAME]  # no temporary folder left behind
    assert (tmp_path / NAME / "config.json").is_file()
    stamp = (tmp_path / NAME / "model.safetensors").stat().st_mtime_ns

    again = _spawn(tmp_path)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and out.strip() == str(tmp_path / NAME)
    assert "pulling" not in err
    assert (tmp_path / NAME / "model.safetensors").stat().st_mtime_ns == stamp


def test_resolve_model_finds_a_pulled_source(pulled_models: Path) -> None:
    messages: list[str] = []
    path = pull(NAME, pulled_models, progress=messages.append)
    assert messages == []  # already there: nothing rebuilt
    assert resolve.resolve_model(NAME, pulled_models) == path == pulled_models / NAME
    assert resolve.resolve_model(str(path), pulled_models) == path  # a folder resolves to itself


def test_unknown_source_lists_the_names(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as err:
        get_source("gpt-5")
    for name in SOURCES:
        assert name in str(err.value)
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli.main", "models", "pull", "gpt-5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and NAME in proc.stderr
    assert not list(tmp_path.iterdir())
