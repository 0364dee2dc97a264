"""Large intermediate tensors (embeddings, latents, audio) in the data plane (DESIGN §4.3).

``TensorClient.put`` streams an array into the node's kv-agent (``PutTensor``) and returns
the ``TensorRef`` that travels in messages instead of the bytes; ``get`` streams it back
from whichever agent the ref names (``GetTensor``) and verifies its checksum. Errors are
``omniflow.errors`` domain errors, never gRPC ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.errors import DataLoss, InvalidArgument
from omniflow.kv.checksum import page_checksum
from omniflow.rpc.client import open_channel
from omniflow.rpc.context import failed_call
from omniflow.rpc.interceptors import TracedChannel

CHUNK_BYTES = 1024 * 1024
DTYPES = ("float32", "float16", "int16", "int32", "int64", "uint8")


class TensorClient:
    """Put tensors into the local agent; get them from any agent by reference."""

    def __init__(self, agent_address: str, *, timeout_s: float = 10.0) -> None:
        self.agent_address = agent_address
        self.timeout_s = timeout_s
        self._channels: dict[str, TracedChannel] = {}

    def _stub(self, address: str) -> kvagent_pb2_grpc.KVAgentServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, default_timeout_s=self.timeout_s)
        return kvagent_pb2_grpc.KVAgentServiceStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def put(self, array: np.ndarray, ttl_s: float = 0.0) -> common_pb2.TensorRef:
        """Store ``array`` in the local agent; ``ttl_s`` 0 takes the agent's default."""
        arr = np.ascontiguousarray(array)
        if arr.dtype.name not in DTYPES:
            raise InvalidArgument(f"dtype {arr.dtype.name} is not accepted; accepted: {DTYPES}")
        raw = arr.reshape(-1).view(np.uint8)
        header = kvagent_pb2.TensorChunk(
            shape=list(arr.shape),
            dtype=arr.dtype.name,
            checksum=page_checksum(raw),
            size_bytes=raw.size,
            ttl_ms=int(ttl_s * 1000),
        )

        async def chunks() -> AsyncIterator[kvagent_pb2.TensorChunk]:
            first = True
            for off in range(0, max(raw.size, 1), CHUNK_BYTES):
                c = kvagent_pb2.TensorChunk() if not first else header
                c.data = raw[off : off + CHUNK_BYTES].tobytes()
                c.offset = off
                first = False
                yield c

        with failed_call(f"kv agent {self.agent_address} PutTensor"):
            reply = await self._stub(self.agent_address).PutTensor(chunks())
        return reply.ref

    async def get(self, ref: common_pb2.TensorRef) -> np.ndarray:
        """The tensor ``ref`` names, read from its owner agent and checksum-verified."""
        if not ref.address or not ref.handle:
            raise InvalidArgument("the tensor reference has no address or handle")
        if ref.dtype not in DTYPES:
            raise InvalidArgument(f"tensor dtype {ref.dtype!r} is not accepted; accepted: {DTYPES}")
        buf = bytearray()
        with failed_call(f"tensor {ref.handle} at {ref.address}"):
            async for c in self._stub(ref.address).GetTensor(
                kvagent_pb2.GetTensorRequest(ref=ref, chunk_bytes=CHUNK_BYTES)
            ):
                buf += c.data
        if len(buf) != ref.size_bytes or page_checksum(buf) != ref.checksum:
            raise DataLoss(f"tensor {ref.handle} from {ref.address} failed its checksum")
        arr = np.frombuffer(bytes(buf), dtype=np.dtype(ref.dtype))
        return arr.reshape(tuple(ref.shape))
