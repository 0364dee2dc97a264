"""The coordinator's hinter on chat prompts (no network): the ids are the model's templated
ids, the hashes those of the library, the ids for the worker come from the same cache, and a
model without a template is a counted fallback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omniflow.chat import Preprocessor
from omniflow.kv.blocks import block_hashes
from omniflow.models.resolve import resolve_model
from omniflow.workers import WorkerRecord
from omniflow_services.coordinator import kvhints
from omniflow_services.coordinator.kvhints import KVHinter, Prompt

NS = "cd" * 16
QUESTION = " ".join(f"question {i} about the pages of layer {i % 5}" for i in range(12))


def _hinter(folder: Path, namespace: str = NS) -> KVHinter:
    async def workers() -> list[WorkerRecord]:
        return [WorkerRecord("w-1", "llm", "127.0.0.1:1", "n", str(folder), namespace)]

    return KVHinter(workers)


async def test_chat_hints_are_the_templated_ids(tmp_path: Path):
    folder = resolve_model("tiny:qwen2", tmp_path / "models")
    pre = Preprocessor.from_folder(folder, bytes.fromhex(NS))
    hinter = _hinter(folder)
    chat = Prompt(QUESTION, chat=True, system="Be brief.")
    hints = await hinter.hints("llm", chat)
    ids = pre.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    )
    assert hints is not None and list(hints.token_ids) == ids
    assert list(hints.block_hashes) == block_hashes(bytes.fromhex(NS), ids, 16)
    assert len(hints.block_hashes) >= 4 and hints.prompt_tokens == len(ids)
    text = await hinter.hints("llm", QUESTION)
    assert text is not None and list(text.token_ids) == pre.encode_text(QUESTION)
    assert text.block_hashes[0] != hints.block_hashes[0]
    # The worker's ids: the same cached computation, not counted as another Pick.
    assert await hinter.prepared("llm", chat, bytes.fromhex(NS)) is hints
    assert await hinter.prepared("llm", chat, b"\xab" * 16) is None  # another model's worker
    assert hinter.counts == {kvhints.HINTED: 2}
    await hinter.close()


async def test_a_chat_prompt_to_a_model_without_template_is_a_counted_fallback(tmp_path: Path):
    folder = tmp_path / "bare"
    shutil.copytree(resolve_model("tiny:qwen2", tmp_path / "models"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    hinter = _hinter(folder)
    assert await hinter.hints("llm", Prompt(QUESTION, chat=True)) is None
    assert await hinter.hints("llm", QUESTION) is not None  # text prompts still hinted
    assert hinter.counts == {kvhints.NO_TEMPLATE: 1, kvhints.HINTED: 1}
    await hinter.close()
