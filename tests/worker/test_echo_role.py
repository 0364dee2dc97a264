"""The echo TEST engine as the worker's llm role: what it echoes, hashes, aborts, serves."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from omniflow.config import load_settings
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes
from omniflow.sampling import SamplingParams
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.core import WorkerCore
from omniflow_services.worker.echo.engine import ECHO_LAYOUT
from omniflow_services.worker.echo.role import BYTE_BASE, ECHO_OPERATIONS, EchoRole

ECHO_ENV = {"OMNIFLOW_WORKER_ENGINE": "echo"}


def _settings(**env: str) -> WorkerSettings:
    return load_settings(WorkerSettings, env={**ECHO_ENV, **env})


async def _run(role: EchoRole, ids: list[int], max_tokens: int | None = None) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out async for out in role.generate("r-1", ids, params)]


async def test_a_text_prompt_is_echoed_word_by_word_with_its_usage() -> None:
    role = await EchoRole.load(_settings())
    try:
        ids = await role.encode_text("hello there")
        assert ids == [BYTE_BASE + b for b in b"hello there"]
        outs = await _run(role, ids)
        assert [o.text_delta for o in outs] == ["echo:", " hello", " there"]
        assert [o.finished for o in outs] == [False, False, True]
        assert outs[-1].finish_reason == "stop"
        assert (outs[-1].usage.prompt_tokens, outs[-1].usage.generated_tokens) == (11, 3)
        # max_tokens cuts the words.
        assert "".join(o.text_delta for o in await _run(role, ids, 2)) == "echo: hello"
    finally:
        await role.close()


async def test_token_ids_are_echoed_as_numbers_and_chat_as_its_last_user_turn() -> None:
    role = await EchoRole.load(_settings())
    try:
        assert "".join(o.text_delta for o in await _run(role, [7, 8, 9])) == "echo: 7 8 9"
        chat = [
            {"role": "user", "content": [{"type": "text", "text": "first"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "second turn"}]},
        ]
        ids = await role.encode_chat(chat)
        assert "".join(o.text_delta for o in await _run(role, ids)) == "echo: second turn"
    finally:
        await role.close()


async def test_prompt_hashes_are_the_block_hashes_of_its_bytes() -> None:
    role = EchoRole(_settings())
    text = "x" * 40
    ids = await role.encode_text(text)
    want = block_hashes(ECHO_LAYOUT.namespace, list(text.encode()), ECHO_LAYOUT.page_size)
    assert role.prompt_hashes(ids) == want and len(want) == 2
    # Token ids: the hashes of the numbers as echoed.
    numbers = " ".join(map(str, range(20))).encode()
    assert role.prompt_hashes(list(range(20))) == block_hashes(
        ECHO_LAYOUT.namespace, list(numbers), ECHO_LAYOUT.page_size
    )


async def test_abort_ends_a_running_request_with_finish_reason_abort() -> None:
    role = await EchoRole.load(_settings(OMNIFLOW_ECHO_TOKEN_DELAY_MS="50"))
    try:
        shown, rid = role.request_id("req-a")
        ids = await role.encode_text("one two three four five six seven")
        stream = role.generate(rid, ids, SamplingParams(temperature=0.0))
        first = await anext(stream)
        assert first.text_delta == "echo:" and not first.finished
        assert role.abort(shown) and not role.abort("someone-else")
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert role.engine.load().running == 0
    finally:
        await role.close()


async def test_a_cancelled_stream_is_counted_and_leaves_the_batch() -> None:
    role = await EchoRole.load(_settings(OMNIFLOW_ECHO_TOKEN_DELAY_MS="50"))
    try:
        ids = await role.encode_text("a b c d e f g h")

        async def consume() -> None:
            async for _ in role.generate("r-c", ids, SamplingParams(temperature=0.0)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (role.calls, role.cancelled, role.running) == (1, 1, 0)
        assert role.engine.load().running == 0
    finally:
        await role.close()


def test_the_core_advertises_the_stood_in_roles_operations_then_its_own() -> None:
    for role, first in (("llm", ("generate",)), ("talker", ("synthesize",)), ("echo", ())):
        core = WorkerCore(_settings(OMNIFLOW_WORKER_ROLE=role))
        core.echo = core.llm = EchoRole(core.settings)
        core.model = "echo"
        assert core.operations == (*first, *ECHO_OPERATIONS), role


def test_the_echo_role_needs_the_echo_engine() -> None:
    settings = dataclasses.replace(_settings(), role="echo", engine="torch")
    with pytest.raises(InvalidArgument, match="OMNIFLOW_WORKER_ENGINE=echo"):
        WorkerCore(settings)
