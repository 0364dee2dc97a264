#!/usr/bin/env bash
# End-to-end check of the SGLang backend on a GPU machine; prints a short report.
#
#   bash tests/gpu/run_sglang_e2e.sh                 # tiny Qwen2 made by make_tiny
#   OMNIFLOW_E2E_MODEL=/models/Qwen2.5-0.5B bash tests/gpu/run_sglang_e2e.sh
#
# Installs omniflow with its sglang extra when SGLang is missing (needs a package index;
# set PIP_INDEX_URL or pre-install sglang on machines without one). Uses the repo's .venv
# when there is one. Needs a CUDA GPU and redis-server.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PY=${PYTHON:-python}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA GPU visible to torch: this check needs one" >&2
  exit 2
fi
if ! command -v redis-server >/dev/null; then
  echo "redis-server not found (apt-get install redis-server)" >&2
  exit 2
fi
if ! "$PY" -c "import sglang" 2>/dev/null; then
  echo "installing omniflow[sglang] ..."
  "$PY" -m pip install -q -e ".[sglang]" || "$PY" -m pip install -q "sglang[all]"
fi
"$PY" -c "import sglang; print('sglang', sglang.__version__)"
if [[ ! -d libs/omniflow/api/kvagent ]]; then
  make protos
fi

# Model: OMNIFLOW_E2E_MODEL, else a local Qwen2.5-0.5B when present, else make_tiny.
if [[ -z "${OMNIFLOW_E2E_MODEL:-}" ]]; then
  for d in "$HOME/models/Qwen2.5-0.5B" "/models/Qwen2.5-0.5B" "$HOME/.cache/omniflow/models/Qwen2.5-0.5B"; do
    if [[ -f "$d/config.json" ]]; then export OMNIFLOW_E2E_MODEL="$d"; break; fi
  done
fi

exec "$PY" tests/gpu/sglang_e2e.py "$@"
