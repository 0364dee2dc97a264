"""Multimodal roles over real processes: encoder, llm, diffusion and talker workers with a
kv-agent (embeddings as TensorRefs in the data plane) and a kv-index, on a private Redis."""

from __future__ import annotations

import asyncio
import io
import wave
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from mm_cluster import Cluster, make_models, png, start_cluster, wav

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.blocks import item_id
from omniflow.kv.client import KVClient
from omniflow.kv.tensor_client import TensorClient
from omniflow.rpc.client import open_channel

pytestmark = pytest.mark.asyncio

IMAGE = common_pb2.MediaItem.KIND_IMAGE
AUDIO = common_pb2.MediaItem.KIND_AUDIO


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Cluster]:
    pytest.importorskip("PIL", reason="image decoding needs Pillow (the worker extra)")
    models = tmp_path_factory.mktemp("mm-models")
    make_models(models)
    root = tmp_path_factory.mktemp("mm-cluster")
    yield from start_cluster(root, models, ("encoder", "llm", "diffusion", "talker"))


def stub(cluster: Cluster, role: str) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]:
    ch = open_channel(cluster.addresses[role], default_timeout_s=60)
    return ch, worker_pb2_grpc.WorkerServiceStub(ch)


async def _generate(s: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.GenerateRequest):
    outs = [o async for o in s.Generate(req)]
    return outs[-1]


def _chat(parts: list[worker_pb2.ContentPart], max_tokens: int = 2) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        messages=worker_pb2.ChatMessages(
            messages=[worker_pb2.ChatMessage(role="user", content=parts)],
            add_generation_prompt=True,
        ),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _img_part(data: bytes) -> worker_pb2.ContentPart:
    return worker_pb2.ContentPart(media=common_pb2.MediaItem(kind=IMAGE, data=data))


async def test_encode_returns_refs_and_caches_by_item_id(cluster: Cluster) -> None:
    ch, s = stub(cluster, "encoder")
    async with ch:
        img = png(40, 30, seed=1)
        req = worker_pb2.EncodeRequest(
            items=[
                common_pb2.MediaItem(kind=IMAGE, data=img),
                common_pb2.MediaItem(kind=AUDIO, data=wav()),
            ]
        )
        first = await s.Encode(req)
        assert [e.item_id for e in first.items] == [item_id(img), item_id(wav())]
        ref = first.items[0].embeddings
        assert list(ref.shape) == [16, 64] and ref.dtype == "float32" and ref.address
        assert list(first.items[1].embeddings.shape) == [13, 64]  # 0.5 s: 51 frames -> 13
        assert first.cache_hits == 0
        second = await s.Encode(req)
        assert second.cache_hits == 2
        # Raw bytes already in the data plane: the same item, by reference.
        tensors = TensorClient(cluster.addresses["kv-agent"])
        try:
            raw = await tensors.put(np.frombuffer(img, np.uint8))
        finally:
            await tensors.close()
        by_ref = await s.Encode(
            worker_pb2.EncodeRequest(items=[common_pb2.MediaItem(kind=IMAGE, ref=raw)])
        )
        assert by_ref.items[0].item_id == item_id(img) and by_ref.cache_hits == 1


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        (common_pb2.MediaItem(kind=IMAGE, data=b"not an image"), "not a decodable image"),
        (common_pb2.MediaItem(kind=AUDIO, data=b"RIFF....WAVE"), "not a decodable WAV"),
        (common_pb2.MediaItem(kind=AUDIO, data=wav(0.2, 8000)), "sample rate 8000 Hz"),
        (common_pb2.MediaItem(data=b"x"), "media kind is unspecified"),
    ],
)
async def test_encode_bad_input_names_the_item_and_keeps_serving(
    cluster: Cluster, item: common_pb2.MediaItem, needle: str
) -> None:
    ch, s = stub(cluster, "encoder")
    async with ch:
        good = common_pb2.MediaItem(kind=IMAGE, data=png(8, 8))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.Encode(worker_pb2.EncodeRequest(items=[good, item]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "items[1]" in err.value.details() and needle in err.value.details()
        ok = await s.Encode(worker_pb2.EncodeRequest(items=[good]))
        assert len(ok.items) == 1
    assert cluster.alive("encoder")


async def test_image_over_the_size_limit_is_rejected(cluster: Cluster) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4100, 4100)).save(buf, "PNG")  # 16.8 Mpixel > 4096 * 4096
    ch, s = stub(cluster, "encoder")
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.Encode(
                worker_pb2.EncodeRequest(
                    items=[common_pb2.MediaItem(kind=IMAGE, data=buf.getvalue())]
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "items[0]" in err.value.details() and "limit" in err.value.details()


async def test_second_turn_reuses_pages_through_the_image_span(cluster: Cluster) -> None:
    ch, s = stub(cluster, "llm")
    img_a, img_b = png(32, 32, seed=10), png(32, 32, seed=11)
    text = worker_pb2.ContentPart(text="What is in this picture? Describe it in detail please.")
    async with ch:
        t1 = await _generate(s, _chat([_img_part(img_a), text]))
        assert t1.usage.cached_tokens == 0 and t1.usage.prompt_tokens > 16
        t2 = await _generate(s, _chat([_img_part(img_a), text]))
        # Every full page but the one holding the last prompt token is reused.
        full = t2.usage.prompt_tokens // 16
        assert t2.usage.cached_tokens >= (full - 1) * 16 > 16
        assert list(t2.prompt_block_hashes) == list(t1.prompt_block_hashes)
        other = await _generate(s, _chat([_img_part(img_b), text]))
        # "<|im_start|>user\n" is 3 tokens: the image begins on page 0, so no page is shared.
        assert not set(other.prompt_block_hashes) & set(t1.prompt_block_hashes)
        assert other.usage.cached_tokens == 0


async def test_encoded_items_and_placeholders(cluster: Cluster) -> None:
    ech, enc = stub(cluster, "encoder")
    lch, llm = stub(cluster, "llm")
    async with ech, lch:
        img = png(24, 24, seed=20)
        got = (
            await enc.Encode(
                worker_pb2.EncodeRequest(items=[common_pb2.MediaItem(kind=IMAGE, data=img)])
            )
        ).items[0]
        part = worker_pb2.ContentPart(encoded=got)
        by_ref = await _generate(llm, worker_pb2.GenerateRequest(
            text="Look: <|image|> what is it?", items=[part],
            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0)))  # fmt: skip
        by_bytes = await _generate(llm, worker_pb2.GenerateRequest(
            text="Look: <|image|> what is it?", items=[_img_part(img)],
            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0)))  # fmt: skip
        assert list(by_bytes.prompt_block_hashes) == list(by_ref.prompt_block_hashes)
        assert by_bytes.usage.cached_tokens > 0
        for text, items, needle in [
            ("<|image|> and <|image|>", [part], "2 media placeholders"),
            ("no placeholder", [part], "0 media placeholders"),
            ("<|image|> without its item", [], "has 1 media placeholders"),
            ("<|audio|>", [_img_part(img)], "placeholder is <|audio|>"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(llm, worker_pb2.GenerateRequest(text=text, items=items))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert needle in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(llm, _chat([worker_pb2.ContentPart(text="hi"), _img_part(b"garbage")]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].content[1]" in err.value.details()
        ok = await _generate(llm, _chat([worker_pb2.ContentPart(text="still there?")]))
        assert ok.finish_reason
    assert cluster.alive("llm") and cluster.alive("encoder")


async def test_generate_image_png_and_cached_prompt(cluster: Cluster) -> None:
    from PIL import Image

    ch, s = stub(cluster, "diffusion")
    async with ch:
        req = worker_pb2.GenerateImageRequest(
            text="a small red house next to a quiet lake at sunset, oil painting",
            width=64, height=48, steps=3, guidance_scale=2.5, seed=5,
        )  # fmt: skip
        first = await s.GenerateImage(req)
        img = Image.open(io.BytesIO(first.png))
        assert img.size == (64, 48) and img.mode == "RGB"
        again = await s.GenerateImage(req)
        assert again.png == first.png  # same seed, same image
        assert again.cached_prompt_tokens >= 16 and first.prompt_tokens == again.prompt_tokens
        ref = await s.GenerateImage(
            worker_pb2.GenerateImageRequest(text="x", width=32, height=32, steps=1, return_ref=True)
        )
        assert list(ref.ref.shape) == [32, 32, 3] and ref.ref.dtype == "uint8"
        for bad, needle in [
            (worker_pb2.GenerateImageRequest(text="x", width=30), "width 30"),
            (worker_pb2.GenerateImageRequest(text="x", steps=1000), "steps 1000"),
            (worker_pb2.GenerateImageRequest(), "no prompt"),
            (worker_pb2.GenerateImageRequest(prompt_pages=worker_pb2.PromptPages(
                token_ids=common_pb2.TokenIds(ids=[1, 2]), kv_namespace="00" * 16)),
             "another model"),
        ]:  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await s.GenerateImage(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.value.details()
        # The diffusion worker's backbone serves text generation too (same weights).
        out = await _generate(s, _chat([worker_pb2.ContentPart(text="hello")]))
        assert out.finish_reason


async def test_prompt_pages_from_the_llm_worker(cluster: Cluster) -> None:
    lch, llm = stub(cluster, "llm")
    dch, dif = stub(cluster, "diffusion")
    async with lch, dch:
        info_l = (await llm.GetInfo(worker_pb2.GetInfoRequest())).info
        info_d = (await dif.GetInfo(worker_pb2.GetInfoRequest())).info
        assert info_l.kv_namespace == info_d.kv_namespace  # one backbone, one namespace
        prompt = "a lighthouse on a cliff in a storm, dramatic clouds, waves crashing below"
        pre = await _generate(llm, worker_pb2.GenerateRequest(
            messages=worker_pb2.ChatMessages(messages=[worker_pb2.ChatMessage(
                role="user", content=[worker_pb2.ContentPart(text=prompt)])],
                add_generation_prompt=True), prefill_only=True))  # fmt: skip
        ids = list(pre.prompt_token_ids.ids)
        assert len(ids) > 16 and len(pre.prompt_block_hashes) == len(ids) // 16
        pages = worker_pb2.PromptPages(
            token_ids=pre.prompt_token_ids,
            kv_namespace=info_l.kv_namespace,
            block_hashes=pre.prompt_block_hashes,
        )
        # The llm worker wrote its full pages through to the node's agent: wait for them.
        async with KVClient(cluster.addresses["kv-agent"]) as probe:
            for _ in range(200):
                held = await probe.locate(bytes.fromhex(info_l.kv_namespace), pages.block_hashes)
                n = len(held)
                await held.release()
                if n == len(pages.block_hashes):
                    break
                await asyncio.sleep(0.05)
        assert n == len(pages.block_hashes)
        size = {"width": 32, "height": 32, "steps": 2, "seed": 1}
        by_pages = await dif.GenerateImage(
            worker_pb2.GenerateImageRequest(prompt_pages=pages, **size)
        )
        # Pulled from the agent, not recomputed: every full page but one holding the last token.
        assert by_pages.cached_prompt_tokens == (len(ids) - 1) // 16 * 16
        by_text = await dif.GenerateImage(worker_pb2.GenerateImageRequest(text=prompt, **size))
        assert by_pages.prompt_tokens == by_text.prompt_tokens == len(ids)
        assert by_pages.png == by_text.png  # the same prompt tokens, the same image
        assert by_text.cached_prompt_tokens >= 16
        wrong = worker_pb2.PromptPages(
            token_ids=pre.prompt_token_ids,
            kv_namespace=info_l.kv_namespace,
            block_hashes=[bytes(16)],
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dif.GenerateImage(worker_pb2.GenerateImageRequest(prompt_pages=wrong))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "do not match" in err.value.details()


async def test_synthesize_streams_a_16khz_wav(cluster: Cluster) -> None:
    ch, s = stub(cluster, "talker")
    async with ch:
        chunks = [
            c
            async for c in s.Synthesize(
                worker_pb2.SynthesizeRequest(text="Hello, world. How are you?", seed=3)
            )
        ]
        assert len(chunks) >= 2 and chunks[-1].last and not any(c.last for c in chunks[:-1])
        assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
        with wave.open(io.BytesIO(chunks[-1].wav)) as wf:
            assert wf.getframerate() == 16000 and wf.getnchannels() == 1 and wf.getsampwidth() == 2
            frames = wf.readframes(wf.getnframes())
        assert frames == b"".join(c.pcm_s16le for c in chunks)
        assert len(frames) // 2 % 320 == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            # 8 to 48 kHz are resampled (tests/audio); outside that range is an error.
            async for _ in s.Synthesize(worker_pb2.SynthesizeRequest(text="hi", sample_rate=4000)):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "4000" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in s.Synthesize(worker_pb2.SynthesizeRequest(text="")):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.alive("talker")
