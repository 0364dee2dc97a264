"""Fixed-length rows by aiperf: the load generator serving comparisons use, run against any
OpenAI server (the Omni-Flow gateway, vLLM's own) with the same synthetic prompts.

    aiperf profile --model M --url URL --endpoint-type chat --streaming \\
        --tokenizer FOLDER --prompt-input-tokens-mean ISL --prompt-input-tokens-stddev 0 \\
        --prompt-output-tokens-mean OSL --prompt-output-tokens-stddev 0 \\
        --extra-inputs ignore_eos:true --concurrency C --request-count N ...

``ignore_eos`` makes every answer exactly OSL tokens long (vLLM's field: the gateway takes
it too), so two servers are compared on the same work. aiperf lives in a virtualenv of its
own (``scripts/setup_aiperf_venv.sh``: ``~/.cache/omniflow/venvs/aiperf``), never in .venv.
:func:`profile` runs it and reads its JSON export (``profile_export_aiperf.json``): request
and error counts (``error_summary``), the completion tokens the server reported for each
request (``usage``) and aiperf's own count of them (the text tokenized again, which can be
one off at a token boundary; ``osl_mismatch_count`` counts requests off by more than its
tolerance), TTFT, ITL, throughput.
``python bench/aiperf_rows.py --url URL --model M --tokenizer FOLDER`` runs one level.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_AIPERF = Path.home() / ".cache/omniflow/venvs/aiperf/bin/aiperf"


def find_aiperf() -> Path | None:
    """aiperf of ``OMNIFLOW_AIPERF`` or of the default venv, if installed."""
    path = Path(os.environ.get("OMNIFLOW_AIPERF", DEFAULT_AIPERF)).expanduser()
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass(frozen=True, slots=True)
class Row:
    """One aiperf run's figures (ms, tokens/s)."""

    requests: int
    errors: int
    completion_min: float  # the server's usage.completion_tokens, per request
    completion_max: float
    osl_min: float  # aiperf's own count (the text tokenized again: may differ by one)
    osl_max: float
    osl_mismatches: int  # requests whose count aiperf finds off the asked length
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    tok_s: float

    def as_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.__slots__}


def _metric(data: dict, name: str, stat: str) -> float:
    value = data.get(name)
    if isinstance(value, dict):
        got = value.get(stat)
        return float(got) if got is not None else float("nan")
    return float("nan")


def parse_export(path: Path) -> Row:
    """The figures of an aiperf ``profile_export_aiperf.json``."""
    data = json.loads(path.read_text())
    errors = data.get("error_summary") or []
    failed = sum(int(e.get("count", 0)) for e in errors if isinstance(e, dict))
    mismatches = _metric(data, "osl_mismatch_count", "avg")
    return Row(
        requests=int(_metric(data, "request_count", "avg")),
        errors=failed,
        completion_min=_metric(data, "usage_completion_tokens", "min"),
        completion_max=_metric(data, "usage_completion_tokens", "max"),
        osl_min=_metric(data, "output_sequence_length", "min"),
        osl_max=_metric(data, "output_sequence_length", "max"),
        osl_mismatches=0 if mismatches != mismatches else int(mismatches),  # NaN: none
        ttft_p50=_metric(data, "time_to_first_token", "p50"),
        ttft_p99=_metric(data, "time_to_first_token", "p99"),
        itl_p50=_metric(data, "inter_token_latency", "p50"),
        tok_s=_metric(data, "output_token_throughput", "avg"),
    )


def profile(
    url: str,
    model: str,
    tokenizer: Path,
    *,
    concurrency: int,
    requests: int,
    isl: int,
    osl: int,
    api_key: str = "",
    artifacts: Path | None = None,
    aiperf: Path | None = None,
    timeout_s: float = 1800.0,
) -> Row:
    """One aiperf run: ``requests`` streamed chats of ``isl`` prompt tokens, each asked for
    ``osl`` tokens with ``ignore_eos``, ``concurrency`` at once (after 2 warm-up requests).
    Raises RuntimeError with aiperf's output when it fails."""
    exe = aiperf or find_aiperf()
    if exe is None:
        raise RuntimeError(f"no aiperf at {DEFAULT_AIPERF}: run scripts/setup_aiperf_venv.sh")
    out = artifacts or Path(tempfile.mkdtemp(prefix="omniflow-aiperf-"))
    args = [
        str(exe), "profile",
        "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(tokenizer),
        "--prompt-input-tokens-mean", str(isl), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(osl), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--concurrency", str(concurrency), "--request-count", str(requests),
        "--warmup-request-count", "2", "--random-seed", "7",
        "--output-artifact-dir", str(out), "--ui-type", "none",
        "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "2",
    ]  # fmt: skip
    if api_key:
        args += ["--api-key", api_key]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    exports = sorted(out.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not exports:
        raise RuntimeError(
            f"aiperf exited {done.returncode}; artifacts {out}\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return parse_export(exports[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", type=Path, required=True, help="the model's folder")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    args = ap.parse_args()
    row = profile(
        args.url, args.model, args.tokenizer, concurrency=args.concurrency,
        requests=args.requests, isl=args.isl, osl=args.osl, api_key=args.api_key,
    )  # fmt: skip
    print(json.dumps(row.as_dict(), indent=1))
    return 0 if row.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
