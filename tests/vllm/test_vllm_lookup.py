"""The connector's prefix lookup never holds vLLM's scheduler: while the node's kv-agent
cannot answer (the real agent process stopped with SIGSTOP), ``get_num_new_matched_tokens``
answers None (vLLM skips the request for this step and schedules the rest), and once the
agent answers, a later call returns the pages it holds.

The scheduler side of ``OmniflowConnector`` runs in vLLM's virtualenv (a subprocess) against
a real kv-index and kv-agent; the pages are stored from here through the agent's API."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from vllm_cluster import VLLM_ENV, VLLM_PYTHON, VLLMCluster

from omniflow.kv.blocking import AgentPageStore
from omniflow.kv.blocks import ROOT_PARENT, KVLayout, hash_page

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LAYOUT = KVLayout(
    model_id="lookup-test", num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16",
    page_size=16,
)  # fmt: skip

# argv[1]: a JSON job. Stops the agent, asks while it is stopped, resumes it, asks again.
PROBE = r"""
import json, os, signal, sys, time
job = json.loads(sys.argv[1])
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import Request
from omniflow.kv.blocks import KVLayout
from omniflow_services.worker.vllm import connector as oc
tc = oc.transfer_config(job["agent"], job["index"], KVLayout(**job["layout"]), "cpu-vec")
tc["kv_connector_extra_config"]["timeout_s"] = 120  # a stopped agent is slow, not gone
cfg = VllmConfig(cache_config=CacheConfig(block_size=32), kv_transfer_config=KVTransferConfig(**tc))
conn = oc.OmniflowConnector(cfg, KVConnectorRole.SCHEDULER)
sp = SamplingParams(max_tokens=1)
reqs = [Request(f"r{i}", t, sp, None) for i, t in enumerate(job["prompts"])]
os.kill(job["agent_pid"], signal.SIGSTOP)
try:
    stopped = [[list(conn.get_num_new_matched_tokens(r, 0)) for r in reqs] for _ in range(3)]
finally:
    os.kill(job["agent_pid"], signal.SIGCONT)
end = time.monotonic() + 90
answers = [None] * len(reqs)
while None in answers and time.monotonic() < end:
    for i, r in enumerate(reqs):
        if answers[i] is None:
            got = conn.get_num_new_matched_tokens(r, 0)
            answers[i] = list(got) if got[0] is not None else None
    time.sleep(0.02)
# vLLM asks again with a larger local hit (its own prefix cache grew meanwhile).
later = list(conn.get_num_new_matched_tokens(reqs[0], 32))
stats = dict(conn.stats)
conn.shutdown()
print("RESULT " + json.dumps({"stopped": stopped, "answers": answers, "later": later,
                              "stats": stats}), flush=True)
"""


def chain(tokens: list[int], pages: int) -> list[bytes]:
    out, parent = [], ROOT_PARENT
    for i in range(pages):
        parent = hash_page(parent, LAYOUT.namespace, tokens[i * 16 : (i + 1) * 16])
        out.append(parent)
    return out


def test_lookup_answers_later_and_never_waits_for_the_agent(vllm_cluster: VLLMCluster) -> None:
    c = vllm_cluster
    index = c.start("kv_index", "lookup-index", OMNIFLOW_KV_KEY_PREFIX=f"t:{c.tag}:lk:")
    index.wait_ready()
    agent = c.agent("lookup-node").wait_ready()
    stored = list(range(1000, 1000 + 100))  # 6 full pages stored: 3 whole 32-token blocks
    cold = list(range(5000, 5000 + 100))  # nothing stored
    store = AgentPageStore(agent.address, LAYOUT, index_address=index.address)
    try:
        store.register()
        hashes = chain(stored, 6)
        pages = [np.full(LAYOUT.page_bytes, i, dtype=np.uint8) for i in range(6)]
        assert store.put(hashes, pages) == 6
        assert store.exists(hashes) == 6
    finally:
        store.close()
    layout = {
        "model_id": LAYOUT.model_id, "num_layers": LAYOUT.num_layers,
        "num_kv_heads": LAYOUT.num_kv_heads, "head_dim": LAYOUT.head_dim,
        "dtype": LAYOUT.dtype, "page_size": LAYOUT.page_size,
    }  # fmt: skip
    job = {
        "agent": agent.address, "index": index.address, "layout": layout,
        "agent_pid": agent.pid, "prompts": [stored, cold],
    }  # fmt: skip
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", PROBE, json.dumps(job)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, **VLLM_ENV, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    # While the agent is stopped every ask answers "not yet" (the blocking lookup would
    # have waited for the agent, then answered a count).
    assert res["stopped"] == [[[None, False], [None, False]]] * 3
    assert res["stats"]["lookups"] >= 2 and res["stats"]["errors"] == 0
    # Once it answers: 96 of the stored prompt's tokens load (3 whole blocks; never the last
    # prompt token), asynchronously; nothing for the cold prompt.
    assert res["answers"] == [[96, True], [0, False]]
    # A later ask past vLLM's own 32-token hit reuses the answer: the 64 tokens after it.
    assert res["later"] == [64, True]
