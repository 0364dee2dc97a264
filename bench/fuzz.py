"""Fuzz bench: the fuzz tests (tests/fuzz) with more requests, and their table.

    .venv/bin/python bench/fuzz.py [--requests 400] [--seed 1]

Runs ``pytest tests/fuzz`` (one real topology: Redis, kv-index, kv-agent, an llm worker
on the tiny model, an embed worker and an encoder where their model wheels are installed,
router, coordinator, gateway) with ``OMNIFLOW_FUZZ_REQUESTS`` per service, collects each
service's row and prints: requests sent, answers by status code, crashes, INTERNAL/UNKNOWN
(HTTP 500 for the gateway), hangs (no answer within the deadline), RSS before and after,
tracebacks the fuzz added to the service's log, seconds; then the load average. The
gateway's requests cover every route, the newer ones with near-valid bodies of their own
shape (embeddings, tokenize, tool calls, response_format, multipart audio uploads).
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("kv-index", "kv-agent", "llm-1", "embed-1", "encoder-1", "router", "coordinator",
         "gateway")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 400 a service: the default run ends within 5 minutes (a smoke run of 40 a service
    # took 164 s wall, 14 s of it fuzzing, at load average 23 on 2 cores).
    p.add_argument("--requests", type=int, default=400, help="fuzz requests per service")
    p.add_argument("--seed", type=int, default=1, help="fuzz seed (the same seed, the same run)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
    from fuzzer import table  # the tests' own module: one definition of the table

    with tempfile.TemporaryDirectory(prefix="omniflow-fuzz-") as tmp:
        report = Path(tmp) / "rows.jsonl"
        env = {
            **os.environ,
            "OMNIFLOW_FUZZ_REQUESTS": str(args.requests),
            "OMNIFLOW_FUZZ_SEED": str(args.seed),
            "OMNIFLOW_FUZZ_REPORT": str(report),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz"],
            cwd=ROOT, env=env, check=False,
        )  # fmt: skip
        wall = time.monotonic() - started
        lines = report.read_text().splitlines() if report.exists() else []
    rows = [json.loads(line) for line in lines]
    rows.sort(key=lambda r: ORDER.index(r["service"]) if r["service"] in ORDER else len(ORDER))
    print(f"\n{args.requests} fuzz requests per service, seed {args.seed}; rc {done.returncode}")
    print(table(rows))
    for r in rows:
        for bad in r["bad"]:
            print(f"  {r['service']}: {bad}")
    print(f"wall time {wall:.0f} s; load average {os.getloadavg()}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
