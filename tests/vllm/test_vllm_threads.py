"""vLLM CPU's engine in the worker takes its cores as vLLM's own OpenAI server does: alone on
the node, OpenMP threads bound to the cores vLLM's server binds (one core left for the
scheduler and the front end), although the worker's vLLM runs with a KV connector (for
which vLLM itself would reserve one more core); beside other torch workers, unbound.

Reference: vLLM's own plan of its engine processes' cores (``OMPProcessManager``, what its
multiprocess executor applies), once for its server's defaults (no connector, no variable
set) and once for the worker's engine (``cpu_threads``, ``transfer_config``), each in a
fresh interpreter of vLLM's virtualenv."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from vllm_cluster import VLLM_PYTHON, vllm_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# argv[1]: "server" (vLLM's defaults) or the worker's torch workers on the node.
PROBE = r"""
import json, os, sys
from vllm.config import KVTransferConfig, VllmConfig
from vllm.utils.ompmultiprocessing import OMPProcessManager
from omniflow.kv.blocks import KVLayout
from omniflow_services.worker.vllm.backend import cpu_threads
from omniflow_services.worker.vllm.connector_config import transfer_config
if sys.argv[1] == "server":
    cfg = VllmConfig()
else:
    cpu_threads(os.environ, int(sys.argv[1]))
    layout = KVLayout("m", 2, 1, 8, "bfloat16", 16)
    tc = transfer_config("127.0.0.1:1", "127.0.0.1:2", layout, "cpu-vec")
    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(**tc))
m = OMPProcessManager(cfg)
print(json.dumps({"cores": m.cpu_lists, "skip": m.skip_setup}))
"""


def plan(arg: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CPU_", "OMP_"))}
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", PROBE, arg],
        env={**env, "OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "ERROR"},
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_alone_the_worker_binds_the_cores_vllms_server_binds() -> None:
    why = vllm_ready()
    if why:
        pytest.skip(why)
    server, alone = plan("server"), plan("1")
    assert server["cores"], f"vLLM's server binds no core here: {server}"
    assert alone["cores"] == server["cores"]
    assert not alone["skip"]


def test_beside_other_torch_workers_the_worker_binds_nothing() -> None:
    why = vllm_ready()
    if why:
        pytest.skip(why)
    shared = plan("2")
    assert shared["skip"] and shared["cores"] == []
