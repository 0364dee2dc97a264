"""Multimodal role cores without the network: image generation on the shared backbone
(reused prompt K/V == recomputed prompt), encoders and their cache, talker and vocoder."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import TinyModel

from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import item_id
from omniflow.models.resolve import resolve_model
from omniflow.models.tiny_mm import make_image_head
from omniflow_services.worker.engine import Engine, EngineConfig, SamplingParams
from omniflow_services.worker.mm.diffusion import flow_euler, initial_noise
from omniflow_services.worker.mm.encoders import EncoderRole, load_encoder
from omniflow_services.worker.mm.image_role import DiffusionRole, ImageRequest
from omniflow_services.worker.mm.loading import load_roles
from omniflow_services.worker.mm.media import MediaInput
from omniflow_services.worker.mm.talker import TalkerRole

pytest.importorskip("PIL", reason="image decoding needs Pillow (the worker extra)")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mm-unit")
    for spec in ("tiny:qwen2", "tiny:vision-encoder", "tiny:audio-encoder", "tiny:talker"):
        resolve_model(spec, root)
    return root


def _png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _wav(rate: int = 16000, seconds: float = 0.3) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(2)
        wf.setsampwidth(2)
        wf.setframerate(rate)
        wf.writeframes(np.zeros(int(rate * seconds) * 2, "<i2").tobytes())
    return buf.getvalue()


# --- image generation ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [512, 16])
async def test_denoising_with_reused_prompt_kv_equals_recomputing_it(
    tiny: TinyModel, tmp_path: Path, chunk: int
) -> None:
    engine = Engine(tiny.path, EngineConfig(num_pages=64, max_num_batched_tokens=chunk))
    head_dir = make_image_head(tmp_path / "head", backbone=str(tiny.path))
    role = await DiffusionRole.load(head_dir, engine)
    assert role.head.model is engine.model  # one copy of the backbone weights
    cond = list(range(5, 45))  # 40 prompt tokens, 3 pages (the last partial)
    uncond = [1, 2, 3]
    req = ImageRequest("img", cond, uncond, 32, 48, steps=4, guidance=2.0, seed=11)
    first = await role.generate(req)
    assert first.cached_prompt_tokens == 0
    second = await role.generate(req)
    assert second.cached_prompt_tokens == 32  # both full pages reused from the prefix cache
    head = role.head
    ref = flow_euler(
        lambda x, t: head.velocity_recompute(x, t, cond),
        lambda x, t: head.velocity_recompute(x, t, uncond),
        initial_noise(head.latent_shape(32, 48), 11),
        4,
        2.0,
    )
    assert ref.shape == (4, 6, 4)
    torch.testing.assert_close(first.latents, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(second.latents, ref, atol=1e-4, rtol=0)
    assert first.png.startswith(b"\x89PNG")
    # The prompt matters: another prompt gives other latents.
    other = await role.generate(ImageRequest("o", [*cond[:-1], 99], uncond, 32, 48, 4, 2.0, 11))
    assert (other.latents - first.latents).abs().max() > 1e-3


async def test_image_request_limits(tiny: TinyModel, tmp_path: Path) -> None:
    engine = Engine(tiny.path, EngineConfig(num_pages=32))
    role = await DiffusionRole.load(make_image_head(tmp_path / "h", backbone="x"), engine)
    for kw, needle in [
        ({"width": 40}, "width 40"),
        ({"height": 1024}, "height 1024"),
        ({"steps": 0}, "steps 0"),
        ({"guidance": -1.0}, "guidance_scale"),
    ]:
        args = {"width": 32, "height": 32, "steps": 2, "guidance": 1.0, **kw}
        with pytest.raises(InvalidArgument, match=needle):
            await role.generate(ImageRequest("r", [1, 2], [3], **args))  # type: ignore[arg-type]


async def test_diffusion_worker_loads_its_backbone_once_and_serves_text(
    models: Path, tmp_path: Path
) -> None:
    head = make_image_head(tmp_path / "head", backbone="tiny:qwen2")
    loaded = await load_roles("diffusion", str(head), models, EngineConfig(num_pages=64))
    assert loaded.llm is not None and loaded.diffusion is not None
    assert loaded.diffusion.engine is loaded.llm.engine
    assert loaded.diffusion.head.model is loaded.llm.engine.model
    assert loaded.llm.engine.layout.model_id == "tiny-qwen2"  # the LLM workers' namespace
    ids = await loaded.llm.encode_chat([{"role": "user", "content": "a cat"}])
    out = [o async for o in loaded.llm.generate("t", ids, SamplingParams(3))]
    assert out[-1].finished


# --- encoders --------------------------------------------------------------------------------


def test_encoders_shapes_and_cache(models: Path) -> None:
    role = EncoderRole(
        [load_encoder(models / "tiny-vision-encoder"), load_encoder(models / "tiny-audio-encoder")]
    )
    img = _png(50, 20, 1)
    items = [MediaInput("image", img, "items[0]"), MediaInput("audio", _wav(), "items[1]")]
    out = role.encode_sync(items)
    assert out[0].item_id == item_id(img) and out[0].embeddings.shape == (16, 64)
    assert out[1].embeddings.shape == (8, 64)  # 0.3 s: 31 frames -> 16 -> 8 tokens
    assert not out[0].cached and not out[1].cached
    again = role.encode_sync(items)
    assert again[0].cached and again[1].cached
    torch.testing.assert_close(again[0].embeddings, out[0].embeddings)
    other = role.encode_sync([MediaInput("image", _png(50, 20, 2), "x")])[0]
    assert (other.embeddings - out[0].embeddings).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        (MediaInput("image", b"", "items[3]"), "items[3]: the image is empty"),
        (MediaInput("image", b"\x89PNG\r\n\x1a\nbroken", "items[3]"), "not a decodable image"),
        (MediaInput("audio", _wav(rate=44100), "items[3]"), "sample rate 44100 Hz"),
        (MediaInput("audio", b"RIFF", "items[3]"), "not a decodable WAV"),
        (MediaInput("audio", _wav(seconds=31.0), "items[3]"), "the limit is 30 s"),
        (MediaInput("video", b"x", "items[3]"), "video items are not accepted"),
    ],
)
def test_encoder_bad_input_names_the_item(models: Path, item: MediaInput, needle: str) -> None:
    role = EncoderRole(
        [load_encoder(models / "tiny-vision-encoder"), load_encoder(models / "tiny-audio-encoder")]
    )
    with pytest.raises(InvalidArgument, match="items\\[3\\]") as err:
        role.encode_sync([MediaInput("image", _png(8, 8, 0), "items[0]"), item])
    assert needle in str(err.value)
    assert len(role.cache) == 0  # nothing was encoded: the bad item failed the call first


# --- talker ----------------------------------------------------------------------------------


async def test_talker_streams_chunks_and_a_wav(models: Path) -> None:
    talker = TalkerRole(models / "tiny-talker")
    chunks = [c async for c in talker.synthesize("Good morning to you all.", seed=4)]
    again = [c async for c in talker.synthesize("Good morning to you all.", seed=4)]
    assert [c.pcm_s16le for c in chunks] == [c.pcm_s16le for c in again]  # seeded
    assert chunks[-1].last and chunks[-1].wav
    assert all(len(c.pcm_s16le) == 2 * 320 * 25 for c in chunks[:-1])
    with wave.open(io.BytesIO(chunks[-1].wav)) as wf:
        assert wf.getframerate() == 16000
        assert wf.readframes(wf.getnframes()) == b"".join(c.pcm_s16le for c in chunks)
    with pytest.raises(InvalidArgument, match="text is empty"):
        async for _ in talker.synthesize(""):
            pass
