"""Greedy output with each of vLLM's sampling fields equals vLLM CPU's own OpenAI server on the
same SmolLM2 folder (float32 both).

The same JSON body goes to vLLM's ``/v1/completions`` and through our path: the gateway's
protocol model (``to_sampling_params``), the gateway's per-prompt sampling (EOS ids, checks),
the proto both ways (the worker's edge), then the built-in engine (its batched sampler and
detokenizer) in this process; completions ``echo`` through the gateway's own helper. Text,
completion token count and finish reason must be equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_cluster import model_folder
from vllm_server import SERVED_NAME, VLLMServer

from omniflow.chat import Preprocessor
from omniflow.sampling import SamplingError, SamplingParams
from omniflow_services.gateway.core import Prepared, _for_prompt
from omniflow_services.gateway.openai_api import _echo
from omniflow_services.gateway.protocol import CompletionRequest

pytestmark = pytest.mark.integration

CONTEXT = 4096  # vLLM's --max-model-len, and our engine's
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]
TEXT = "The capital of France is"


class Ours:
    """Our path for one completions body: protocol → contract → proto → built-in engine."""

    def __init__(self, model: Path) -> None:
        import torch

        from omniflow_services.worker.engine import Engine, EngineConfig

        torch.set_num_threads(1)
        self.engine = Engine(model, EngineConfig(dtype="float32", max_model_len=CONTEXT))
        layout = self.engine.layout
        self.pre = Preprocessor.from_folder(model, layout.namespace, layout.page_size)
        self.count = 0

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.pre.encode_chat(messages, True))

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        from omniflow_services.worker.engine import GenerateRequest

        req = CompletionRequest.model_validate({"model": SERVED_NAME, **body})
        prompt = req.prompt
        ids = list(prompt) if isinstance(prompt, list) else self.pre.encode_text(prompt)
        sampling = _for_prompt(req.to_sampling_params(), [], len(ids), self.pre)
        params = SamplingParams.from_proto(sampling.to_proto())
        self.count += 1
        rid = f"parity-{self.count}"
        self.engine.add_request(GenerateRequest(rid, tuple(ids), params=params))
        outs = []
        while self.engine.has_unfinished():
            outs.extend(o for o in self.engine.step() if o.request_id == rid)
        text = "".join(o.text_delta for o in outs)
        if req.echo:
            prep = Prepared(SERVED_NAME, [], sampling, ids, pre=self.pre)
            text = _echo(prompt, prep) + ("" if req.echo_only else text)  # type: ignore[arg-type]
        return {
            "text": text,
            "tokens": sum(len(o.new_token_ids) for o in outs),
            "finish_reason": outs[-1].finish_reason,
        }


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory, vllm_server: VLLMServer) -> Ours:
    return Ours(model_folder(tmp_path_factory.mktemp("ours")))


def theirs(server: VLLMServer, body: dict[str, Any]) -> dict[str, Any]:
    reply = server.post("completions", {"model": SERVED_NAME, **body})
    assert "choices" in reply, reply
    choice = reply["choices"][0]
    return {
        "text": choice["text"],
        "tokens": reply["usage"]["completion_tokens"],
        "finish_reason": choice["finish_reason"],
    }


def _case(ours: Ours, name: str) -> dict[str, Any]:
    """The body of case ``name`` (prompts as token ids rendered by our chat template, the
    same ids both servers get; text prompts where the case is about text)."""
    story, capital = ours.chat_ids(STORY), ours.chat_ids(CAPITAL)
    comma = ours.pre.tokenizer.token_to_id(",")
    greedy = {"temperature": 0}
    cases: dict[str, dict[str, Any]] = {
        "baseline": {"prompt": story, "max_tokens": 24},
        "top_k": {"prompt": story, "max_tokens": 24, "top_k": 3},
        "min_p": {"prompt": story, "max_tokens": 24, "min_p": 0.3},
        "repetition_penalty": {"prompt": story, "max_tokens": 40, "repetition_penalty": 1.6},
        "penalties": {
            "prompt": story,
            "max_tokens": 40,
            "presence_penalty": 1.5,
            "frequency_penalty": 1.0,
        },
        "ignore_eos": {"prompt": capital, "max_tokens": 40, "ignore_eos": True},
        "min_tokens": {"prompt": capital, "max_tokens": 60, "min_tokens": 30},
        "stop_token_ids": {"prompt": story, "max_tokens": 40, "stop_token_ids": [comma]},
        "stop_token_ids_kept": {
            "prompt": story,
            "max_tokens": 40,
            "stop_token_ids": [comma],
            "include_stop_str_in_output": True,
        },
        "stop": {"prompt": story, "max_tokens": 40, "stop": [" the", "."]},
        "include_stop_str_in_output": {
            "prompt": story,
            "max_tokens": 40,
            "stop": [" the", "."],
            "include_stop_str_in_output": True,
        },
        "min_tokens_and_stop": {
            "prompt": story,
            "max_tokens": 60,
            "min_tokens": 20,
            "stop": ["."],
        },
        "skip_special_tokens": {
            "prompt": capital,
            "max_tokens": 40,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        },
        "logit_bias": {"prompt": story, "max_tokens": 24, "logit_bias": {"504": -100, "28": 5}},
        "echo": {"prompt": TEXT, "max_tokens": 8, "echo": True},
        "echo_ids": {"prompt": capital, "max_tokens": 8, "echo": True},
        "echo_only": {"prompt": TEXT, "max_tokens": 0, "echo": True},
        "max_tokens_null": {"prompt": TEXT, "max_tokens": None, "ignore_eos": True},
        "max_tokens_unset": {"prompt": TEXT, "ignore_eos": True},
    }
    return {**greedy, **cases[name]}


CASES = [
    "baseline",
    "top_k",
    "min_p",
    "repetition_penalty",
    "penalties",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "stop_token_ids_kept",
    "stop",
    "include_stop_str_in_output",
    "min_tokens_and_stop",
    "skip_special_tokens",
    "logit_bias",
    "echo",
    "echo_ids",
    "echo_only",
    "max_tokens_null",
    "max_tokens_unset",
]


@pytest.mark.parametrize("name", CASES)
def test_greedy_output_equals_vllms_server(name: str, ours: Ours, vllm_server: VLLMServer) -> None:
    body = _case(ours, name)
    want = theirs(vllm_server, body)
    got = ours.complete(body)
    assert got == want, f"{name}: ours {got!r}, vLLM {want!r}"


def test_fixed_length_and_bias_do_what_they_say(ours: Ours, vllm_server: VLLMServer) -> None:
    """Not vacuous: ignore_eos runs past the EOS the plain answer ends at, min_tokens holds
    it off, the bias changes the first token."""
    free = theirs(vllm_server, {**_case(ours, "ignore_eos"), "ignore_eos": False})
    assert free["finish_reason"] == "stop" and free["tokens"] < 30
    assert theirs(vllm_server, _case(ours, "ignore_eos"))["tokens"] == 40
    assert theirs(vllm_server, _case(ours, "min_tokens"))["tokens"] >= 30
    base = ours.complete(_case(ours, "baseline"))
    assert ours.complete(_case(ours, "logit_bias"))["text"] != base["text"]


def test_max_tokens_beyond_the_context_is_refused_by_both(
    ours: Ours, vllm_server: VLLMServer
) -> None:
    """More than the whole context is a 400 in both (vLLM 0.32 cuts a max_tokens that only
    overflows with the prompt to the room left, as ours does: test_sampling.py)."""
    body = {"prompt": TEXT, "max_tokens": CONTEXT + 1, "temperature": 0}
    assert vllm_server.post("completions", {"model": SERVED_NAME, **body}).get("status") == 400
    with pytest.raises(SamplingError) as err:
        ours.complete(body)
    assert err.value.field == "max_tokens"
