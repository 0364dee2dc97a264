"""Real worker processes: an encoder worker with Whisper tiny.en transcribes through Invoke
(and says so in discovery), a talker worker speaks with the Piper voice; bad input is
INVALID_ARGUMENT naming the field, and both go on serving."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from audio_clips import espeak, wer

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.discovery import make_registry
from omniflow.rpc.client import open_channel
from omniflow.workers import WORKER_SERVICE, worker_from_instance

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

SPOKEN = "Please call Stella and ask her to bring these things with her from the store."
ANSWER = "The park opens in the morning. Bring a warm coat, because the wind is cold."


def _env(role: str, model: Path, models_dir: Path) -> dict[str, str]:
    return {
        "OMNIFLOW_WORKER_ROLE": role,
        "OMNIFLOW_WORKER_MODEL": str(model),
        "OMNIFLOW_MODELS_DIR": str(models_dir),
        "OMNIFLOW_NODE_ID": "audio-node",
        "OMNIFLOW_WORKER_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "OMNIFLOW_METRICS_PORT": "0",
    }


def _metric(proc, name: str) -> float:
    """The value of one unlabelled sample on ``proc``'s /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    port = proc.info["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{proc.name} exports no {name}")


async def _transcribe(stub: worker_pb2_grpc.WorkerServiceStub, audio: common_pb2.Value) -> str:
    reply = await stub.Invoke(
        worker_pb2.InvokeRequest(operation="transcribe", inputs={"audio": audio}), timeout=120
    )
    return reply.outputs["text"].text


async def _speak(stub: worker_pb2_grpc.WorkerServiceStub, text: str, rate: int = 0) -> list:
    call = stub.Synthesize(worker_pb2.SynthesizeRequest(text=text, sample_rate=rate), timeout=120)
    return [c async for c in call]


async def test_transcribe_and_speak_through_workers(
    launch, private_redis, whisper_dir: Path, piper_dir: Path, tmp_path: Path
) -> None:
    enc = launch(
        "omniflow_services.worker", "whisper-enc", **_env("encoder", whisper_dir, tmp_path)
    )
    tlk = launch("omniflow_services.worker", "piper-talker", **_env("talker", piper_dir, tmp_path))
    enc.wait_ready(180)
    tlk.wait_ready(180)

    registry = make_registry("redis", url=private_redis.url)
    try:
        found = {
            i.instance_id: worker_from_instance(i) for i in await registry.list(WORKER_SERVICE)
        }
    finally:
        await registry.close()
    # The router and coordinator find transcribe by the operations a worker registers.
    assert "transcribe" in found["whisper-enc"].operations
    assert "synthesize" in found["piper-talker"].operations

    async with open_channel(enc.address) as ech, open_channel(tlk.address) as tch:
        e, t = worker_pb2_grpc.WorkerServiceStub(ech), worker_pb2_grpc.WorkerServiceStub(tch)
        info = await e.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert "transcribe" in info.info.operations

        text = await _transcribe(e, common_pb2.Value(bytes_value=espeak(SPOKEN)))
        assert wer(SPOKEN, text) <= 0.25, text

        chunks = await _speak(t, ANSWER)
        assert len(chunks) == 2 and chunks[-1].last and not chunks[0].last
        assert {c.sample_rate for c in chunks} == {16000}
        assert chunks[0].pcm_s16le  # the first sentence arrives before the second
        media = common_pb2.Value(
            media=common_pb2.MediaItem(kind=common_pb2.MediaItem.KIND_AUDIO, data=chunks[-1].wav)
        )
        heard = await _transcribe(e, media)
        assert wer(ANSWER, heard) <= 0.25, heard
        native = await _speak(t, "Hello there.", 22050)
        assert native[-1].sample_rate == 22050 and native[-1].wav

        bad = [
            (e.Invoke(worker_pb2.InvokeRequest(operation="transcribe",
                      inputs={"audio": common_pb2.Value(bytes_value=b"\x01not audio" * 40)}),
                      timeout=30), "inputs.audio: not a decodable audio file"),
            (e.Invoke(worker_pb2.InvokeRequest(operation="transcribe",
                      inputs={"speech": common_pb2.Value(text="x")}), timeout=30),
             "inputs.audio is missing"),
            (e.Invoke(worker_pb2.InvokeRequest(operation="transcribe",
                      inputs={"audio": common_pb2.Value(text="hello")}), timeout=30),
             "inputs.audio is a text"),
            (_speak(t, ""), "text is empty"),
            (_speak(t, "Hello.", 1000), "sample_rate 1000 Hz is out of range"),
        ]  # fmt: skip
        for call, message in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert message in (err.value.details() or ""), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await t.Invoke(worker_pb2.InvokeRequest(operation="transcribe"), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # a talker, not an encoder

        # Both keep serving after the bad calls.
        assert (
            wer(SPOKEN, await _transcribe(e, common_pb2.Value(bytes_value=espeak(SPOKEN)))) <= 0.25
        )
        assert (await _speak(t, "Still here."))[-1].wav
    assert enc.popen.poll() is None and tlk.popen.poll() is None
    assert _metric(enc, "omniflow_worker_transcribe_seconds_count") == 3  # the good calls
    assert 10.0 < _metric(enc, "omniflow_worker_transcribed_audio_seconds_total") < 30.0
    assert _metric(tlk, "omniflow_worker_synthesize_first_chunk_seconds_count") == 3
    assert _metric(tlk, "omniflow_worker_synthesize_seconds_count") == 3
    assert _metric(tlk, "omniflow_worker_synthesized_audio_seconds_total") > 3.0


async def test_a_workflow_speaks_and_hears_through_the_coordinator(
    launch, whisper_dir: Path, piper_dir: Path, tmp_path: Path
) -> None:
    """talker.synthesize → encoder.transcribe as a graph: the router finds the Whisper
    worker by its ``transcribe`` operation and the coordinator calls it through Invoke."""
    from omniflow.client import Client
    from omniflow.dsl import VType, Workflow

    enc = launch(
        "omniflow_services.worker", "whisper-enc", **_env("encoder", whisper_dir, tmp_path)
    )
    tlk = launch("omniflow_services.worker", "piper-talker", **_env("talker", piper_dir, tmp_path))
    enc.wait_ready(180)
    tlk.wait_ready(180)
    router = launch("omniflow_services.router", "router").wait_ready()
    coord = launch(
        "omniflow_services.coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router.address
    ).wait_ready()

    wf = Workflow("speak-and-hear", deadline_ms=120_000)
    said = wf.call("say", "talker", "synthesize", text=wf.input("text", VType.TEXT))
    heard = wf.call("hear", "encoder", "transcribe", audio=said["wav"])
    wf.output("heard", heard["text"])
    wf.output("rate", said["sample_rate"])
    async with Client(coord.address) as client:
        await client.register(wf)
        result = await client.run("speak-and-hear", {"text": ANSWER})
        assert result.ok, result.error
        assert result.outputs["rate"] == 16000
        assert wer(ANSWER, result.outputs["heard"]) <= 0.25, result.outputs["heard"]
        failed = await client.run("speak-and-hear", {"text": ""})
        assert not failed.ok and "text is empty" in failed.error
