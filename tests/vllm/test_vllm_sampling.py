"""Our sampling parameters as vLLM's: every field reaches ``vllm.SamplingParams`` with the
same meaning (checked in vLLM's own virtualenv, where its validation runs)."""

from __future__ import annotations

import json
import subprocess

import pytest
from vllm_cluster import VLLM_PYTHON, vllm_ready

from omniflow_services.worker.engine import SamplingParams
from omniflow_services.worker.vllm.backend import sampling_to_vllm

PROBE = """
import json, sys
from vllm import SamplingParams
names = ["max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
         "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
         "ignore_eos", "logprobs", "min_tokens", "logit_bias", "include_stop_str_in_output",
         "skip_special_tokens"]
out = []
for kw in json.loads(sys.argv[1]):
    p = SamplingParams(**kw)
    out.append({n: getattr(p, n) for n in names})
print("RESULT " + json.dumps(out))
"""


def vllm_view(kwargs: list[dict]) -> list[dict]:
    """What vLLM makes of each kwargs (one subprocess: importing vLLM takes a while)."""
    why = vllm_ready()
    if why:
        pytest.skip(why)
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", PROBE, json.dumps(kwargs)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_every_field_reaches_vllm_and_off_means_off() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05,
        repetition_penalty=1.1, seed=3, stop_token_ids=(2, 5), stop=("\n\n",),
        ignore_eos=True, min_tokens=2, logit_bias=((5, -3.0),), include_stop_str_in_output=True,
        skip_special_tokens=False,
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    scored = SamplingParams(
        max_tokens=3, presence_penalty=0.5, frequency_penalty=-0.25, logprobs=True, top_logprobs=5
    )
    got, off, lp = vllm_view([sampling_to_vllm(p) for p in (params, greedy, scored)])
    assert got["max_tokens"] == 7 and got["seed"] == 3 and got["ignore_eos"] is True
    assert got["top_k"] == 20 and got["stop"] == ["\n\n"] and got["stop_token_ids"] == [2, 5]
    for name, want in (("temperature", 0.7), ("top_p", 0.9), ("min_p", 0.05)):
        assert got[name] == pytest.approx(want), name
    assert got["repetition_penalty"] == pytest.approx(1.1)
    assert got["min_tokens"] == 2 and got["logit_bias"] in ({5: -3.0}, {"5": -3.0})
    assert got["include_stop_str_in_output"] is True and got["skip_special_tokens"] is False
    assert off["min_tokens"] == 0 and not off["logit_bias"] and off["skip_special_tokens"]
    assert got["presence_penalty"] == 0.0 and got["frequency_penalty"] == 0.0
    assert got["logprobs"] is None
    # Greedy, and every filter off, as vLLM spells "off".
    assert off["temperature"] == 0.0 and off["top_k"] in (0, -1) and off["top_p"] == 1.0
    assert off["stop"] == [] and off["stop_token_ids"] == [] and off["seed"] is None
    assert lp["presence_penalty"] == 0.5 and lp["frequency_penalty"] == -0.25
    assert lp["logprobs"] == 5
