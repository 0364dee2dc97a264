#!/usr/bin/env bash
# The virtualenv aiperf runs from (bench/serve_openai.py --aiperf; docs/gateway.md).
#
# aiperf (NVIDIA's OpenAI-API load generator, what serving comparisons use for fixed-length
# rows) brings its own stack (pydantic, zmq, textual, ...), so it gets a venv of its own and
# never changes .venv's packages: ~/.cache/omniflow/venvs/aiperf (or $OMNIFLOW_AIPERF_VENV).
# It is a client only: nothing of this checkout goes into it.
# Idempotent: a second run only re-checks. Prints the aiperf executable on its last line.
set -euo pipefail
VENV="${OMNIFLOW_AIPERF_VENV:-$HOME/.cache/omniflow/venvs/aiperf}"
PACKAGE="${OMNIFLOW_AIPERF_PACKAGE:-aiperf==0.13.0}"
PY="$VENV/bin/python"

if [ ! -x "$VENV/bin/aiperf" ]; then
  echo "creating the aiperf venv at $VENV ($PACKAGE)" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$PACKAGE"
fi
"$VENV/bin/aiperf" --version >/dev/null 2>&1 || "$VENV/bin/aiperf" --help >/dev/null
echo "$VENV/bin/aiperf"
