"""``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message`` mean
what they mean in vLLM: the greedy answer of each equals vLLM CPU's own OpenAI server on the
same folder (SmolLM2-135M-Instruct, float32 both).

The folder is SmolLM2's with a chat template that also reads one variable of its own
(``assistant_name``, for ``chat_template_kwargs``), so that both servers render it. The same
JSON chat body goes to vLLM's ``/v1/chat/completions`` and through our path: the gateway's
protocol model, its template options (``tool_calls.template_options``), the library's
templating (``Preprocessor.encode_chat``), the contract through the proto, and the built-in
engine in this process. Text and finish reason must be equal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_cluster import model_folder, vllm_ready
from vllm_server import SERVED_NAME, VLLMServer

from omniflow.chat import Preprocessor
from omniflow.sampling import SamplingParams
from omniflow_services.gateway.core import _for_prompt
from omniflow_services.gateway.protocol import ChatCompletionRequest
from omniflow_services.gateway.tool_calls import template_options

pytestmark = pytest.mark.integration

CONTEXT = 4096
# SmolLM2's own template, its default system turn naming the assistant by a variable.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named ' + (assistant_name if "
    "assistant_name is defined else 'SmolLM') + ', trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NAME = [{"role": "user", "content": "What is your name?"}]
PREFIX = [
    {"role": "user", "content": "Tell me a short story about a cat."},
    {"role": "assistant", "content": "Once upon a time, a cat named"},
]
CASES: dict[str, dict[str, Any]] = {
    "baseline": {"messages": NAME},
    "chat_template_kwargs": {
        "messages": NAME,
        "chat_template_kwargs": {"assistant_name": "Captain Pagecache"},
    },
    "add_generation_prompt_false": {"messages": NAME, "add_generation_prompt": False},
    "continue_final_message": {
        "messages": PREFIX,
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "final_assistant_not_continued": {"messages": PREFIX},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 (its files linked) with the template above."""
    why = vllm_ready()
    if why:
        pytest.skip(why)
    src = model_folder(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("smollm2-kwargs") / "smollm2-135m-instruct"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f.resolve())
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """vLLM's own server (the tests' VLLMServer, the reference of every parity test) on the
    folder with the extended template."""
    srv = VLLMServer(folder, tmp_path_factory.mktemp("vllm-template"))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def ours(folder: Path, server: VLLMServer):
    import torch

    from omniflow_services.worker.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    engine = Engine(folder, EngineConfig(dtype="float32", max_model_len=CONTEXT))
    pre = Preprocessor.from_folder(folder, engine.layout.namespace, engine.layout.page_size)
    return engine, pre


def our_answer(ours, body: dict[str, Any], rid: str) -> dict[str, Any]:
    from omniflow_services.worker.engine import GenerateRequest

    engine, pre = ours
    req = ChatCompletionRequest.model_validate({"model": SERVED_NAME, **body})
    ids = pre.encode_chat(body["messages"], **template_options(req, None))
    sampling = _for_prompt(req.to_sampling_params(), [], len(ids), pre)
    params = SamplingParams.from_proto(sampling.to_proto())
    engine.add_request(GenerateRequest(rid, tuple(ids), params=params))
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return {"text": "".join(o.text_delta for o in outs), "finish_reason": outs[-1].finish_reason}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_chat_equals_vllm(ours, server: VLLMServer, name: str) -> None:
    body = {"temperature": 0, "max_tokens": 32, **CASES[name]}
    reply = server.post("chat/completions", {"model": SERVED_NAME, **body})
    assert "choices" in reply, reply
    choice = reply["choices"][0]
    theirs = {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}
    assert our_answer(ours, body, f"t-{name}") == theirs


def test_the_kwarg_changes_the_answer(ours) -> None:
    # The variable reaches the template: the rendered prompts differ (so the cases differ).
    pre = ours[1]
    plain = pre.render_chat(NAME)
    named = pre.render_chat(NAME, template_kwargs={"assistant_name": "Captain Pagecache"})
    assert "named SmolLM," in plain and "named Captain Pagecache," in named


def test_both_flags_are_refused_by_both(ours, server: VLLMServer) -> None:
    body = {"messages": PREFIX, "continue_final_message": True, "max_tokens": 4}
    reply = server.post("chat/completions", {"model": SERVED_NAME, **body})
    assert reply.get("status") == 400, reply
    from omniflow_services.gateway.errors import APIError

    req = ChatCompletionRequest.model_validate({"model": SERVED_NAME, **body})
    with pytest.raises(APIError) as info:
        template_options(req, None)
    assert info.value.status == 400 and info.value.param == "continue_final_message"
