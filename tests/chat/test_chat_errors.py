"""Chat errors through a real worker process, as the caller sees them: a template that
raises is INVALID_ARGUMENT with the template's own message; a model without a template
answers messages with INVALID_ARGUMENT naming the model and what it accepts, and still
serves text prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.models.resolve import resolve_model
from omniflow.rpc.client import open_channel

transformers = pytest.importorskip("transformers", reason="the reference is transformers")

ALTERNATING = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _copy(src: Path, dst: Path, template: str | None) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    return dst


def _chat(*turns: tuple[str, str]) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        messages=worker_pb2.ChatMessages(
            messages=[
                worker_pb2.ChatMessage(role=r, content=[worker_pb2.ContentPart(text=t)])
                for r, t in turns
            ],
            add_generation_prompt=True,
        ),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
    )


async def _run(stub, request) -> worker_pb2.GenerateResponse:  # type: ignore[no-untyped-def]
    last = None
    async for chunk in stub.Generate(request, timeout=60):
        last = chunk
    assert last is not None
    return last


@pytest.mark.integration
async def test_template_errors_reach_the_caller_as_invalid_argument(launch, tmp_path: Path):
    tiny = resolve_model("tiny:qwen2", tmp_path / "models")
    raising = _copy(tiny, tmp_path / "alternating", ALTERNATING)
    bare = _copy(tiny, tmp_path / "bare", None)
    worker = launch(
        "omniflow_services.worker",
        "llm-chat-errors",
        OMNIFLOW_WORKER_ROLE="llm",
        OMNIFLOW_WORKER_MODEL=str(raising),
        OMNIFLOW_WORKER_KV_BYTES=str(8 * 1024 * 1024),
        OMNIFLOW_WORKER_TORCH_THREADS="1",
    ).wait_ready(timeout_s=120)
    ref = transformers.AutoTokenizer.from_pretrained(raising)
    async with open_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        ok = await _run(stub, _chat(("user", "hi"), ("assistant", "hello"), ("user", "sea?")))
        want = ref.apply_chat_template(
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "sea?"},
            ],
            add_generation_prompt=True,
            return_dict=False,
        )
        assert ok.usage.prompt_tokens == len(want)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _run(stub, _chat(("user", "a"), ("user", "b")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Conversation roles must alternate" in err.value.details()
        assert "alternating" in err.value.details()  # the model is named

        loaded = await stub.LoadModel(worker_pb2.LoadModelRequest(model_path=str(bare)))
        assert loaded.model == str(bare)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _run(stub, _chat(("user", "hi")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model bare has no chat template" in err.value.details()
        assert "send a text prompt or token_ids" in err.value.details()
        text = await _run(
            stub,
            worker_pb2.GenerateRequest(
                text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2)
            ),
        )
        assert text.usage.prompt_tokens == len(ref("Hello").input_ids)
