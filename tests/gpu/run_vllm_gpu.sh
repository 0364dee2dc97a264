#!/usr/bin/env bash
# The vLLM backend on a GPU machine, in one call; prints the tables.
#
#   bash tests/gpu/run_vllm_gpu.sh
#   OMNIFLOW_E2E_MODEL=/models/Qwen2.5-0.5B-Instruct bash tests/gpu/run_vllm_gpu.sh
#
# 1. vLLM for CUDA in a virtualenv of its own (scripts/setup_vllm_venv.sh with
#    OMNIFLOW_VLLM_PACKAGE=vllm==0.32.0, at ~/.cache/omniflow/venvs/vllm-gpu), with this
#    checkout installed into it;
# 2. the engine benchmark (bench/engine_vs_vllm.py) against that vLLM: tokens/s table;
# 3. the vLLM backend's tests (tests/vllm) on the GPU: greedy outputs equal vLLM alone, the
#    cross-worker prefix load through the kv-agents, the agent killed before the pull.
# Needs a CUDA GPU, redis-server and a package index for the first run. Never run on the
# CPU-only machines this project is built on (no GPU there): see docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=.venv/bin/python
if [[ ! -x "$PY" ]]; then
  make setup
fi
if ! nvidia-smi >/dev/null 2>&1; then
  echo "no NVIDIA GPU here (nvidia-smi fails): this check needs one" >&2
  exit 2
fi
if ! command -v redis-server >/dev/null; then
  echo "redis-server not found (apt-get install redis-server)" >&2
  exit 2
fi
[[ -d libs/omniflow/api/kvagent ]] || make protos

export OMNIFLOW_VLLM_VENV="${OMNIFLOW_VLLM_VENV:-$HOME/.cache/omniflow/venvs/vllm-gpu}"
export OMNIFLOW_VLLM_PACKAGE="${OMNIFLOW_VLLM_PACKAGE:-vllm==0.32.0}"
VPY="$(bash scripts/setup_vllm_venv.sh | tail -n 1)"
"$VPY" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'cuda', torch.cuda.is_available())"

MODEL="${OMNIFLOW_E2E_MODEL:-$HOME/.cache/omniflow/models/smollm2-135m-instruct}"
if [[ ! -f "$MODEL/config.json" ]]; then
  .venv/bin/omniflow models pull
fi

echo
echo "== engine benchmark: built-in engine vs vLLM (GPU), tokens/s"
BENCH_ARGS=(--model "$MODEL" --vllm-python "$VPY" --concurrency 1,8,32 --dtypes bfloat16)
if "$PY" bench/engine_vs_vllm.py --help 2>/dev/null | grep -q -- "--device"; then
  BENCH_ARGS+=(--device cuda)
else
  echo "(bench/engine_vs_vllm.py has no --device: the built-in engine column runs on CPU)"
fi
"$PY" bench/engine_vs_vllm.py "${BENCH_ARGS[@]}"

echo
echo "== vLLM backend through the worker API on the GPU (tests/vllm)"
OMNIFLOW_VLLM_TEST_DEVICE=cuda OMNIFLOW_VLLM_TEST_MODEL="$MODEL" \
  .venv/bin/pytest -q -p no:cacheprovider tests/vllm -rA
