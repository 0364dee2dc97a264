"""Fuzz the embed worker and the encoder (Whisper) over gRPC on the shared fuzz topology:
malformed ``Invoke`` of their operations (``embed.embed``: texts or token ids;
``encoder.transcribe``: audio bytes and options) and every other worker RPC. No crash, no
INTERNAL, and the same answer to the canary before and after."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from conftest import FuzzTopology
from fuzzer import Templates
from test_fuzz_grpc import _fuzz_service, _service

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.rpc.client import open_channel
from omniflow.values import from_python
from omniflow.wav import wav_bytes

pytestmark = pytest.mark.integration


def _wav(seconds: float, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pcm = (rng.standard_normal(int(16_000 * seconds)) * 2000).astype("<i2").tobytes()
    return wav_bytes(pcm, 16_000)


def _canary(role: str) -> worker_pb2.InvokeRequest:
    if role == "embed":
        inputs = {"texts": from_python(["the fuzz canary says"])}
        return worker_pb2.InvokeRequest(request_id="canary", operation="embed", inputs=inputs)
    audio = common_pb2.Value(bytes_value=_wav(0.5))
    inputs = {"audio": audio, "temperature": from_python(0.0), "seed": from_python(1)}
    return worker_pb2.InvokeRequest(request_id="canary", operation="transcribe", inputs=inputs)


def _templates(role: str) -> Templates:
    if role == "embed":
        invoke = [
            _canary(role),
            worker_pb2.InvokeRequest(
                operation="embed", inputs={"token_ids": from_python([[101, 2023, 102]])}
            ),
            worker_pb2.InvokeRequest(
                operation="embed",
                inputs={"texts": from_python(["a", "b"]), "dimensions": from_python(8)},
            ),
        ]
    else:
        invoke = [
            _canary(role),
            worker_pb2.InvokeRequest(
                operation="transcribe",
                inputs={
                    "audio": common_pb2.Value(bytes_value=_wav(0.2, 1)),
                    "temperature": from_python(0.0),
                    "language": from_python("en"),
                },
            ),
            worker_pb2.InvokeRequest(
                operation="transcribe", inputs={"audio": common_pb2.Value(bytes_value=b"RIFF")}
            ),
        ]
    return {"Invoke": invoke, "GetInfo": [worker_pb2.GetInfoRequest()]}


async def _invoke(address: str, request: worker_pb2.InvokeRequest) -> bytes:
    request.request_id = uuid.uuid4().hex
    async with open_channel(address) as ch:
        reply = await worker_pb2_grpc.WorkerServiceStub(ch).Invoke(request, timeout=120)
    return reply.SerializeToString(deterministic=True)


@pytest.mark.parametrize("role", ["embed", "encoder"])
async def test_fuzz_media_worker(fuzz_topology: FuzzTopology, role: str) -> None:
    topo = fuzz_topology
    name = f"{role}-1"
    if name not in topo.procs:
        pytest.skip(f"no {role} worker in the fuzz topology: its model's wheel is not installed")
    before = await _invoke(topo.addr(name), _canary(role))
    await _fuzz_service(
        topo,
        name,
        [_service(worker_pb2, "WorkerService")],
        sizes=(64 << 10, 1 << 20),
        templates=_templates(role),
    )
    assert await _invoke(topo.addr(name), _canary(role)) == before
