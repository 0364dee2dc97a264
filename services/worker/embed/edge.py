"""The worker's gRPC edge of the embed role's ``Invoke`` operation.

``embed``: inputs ``texts`` (a list of strings, tokenized here) or ``token_ids`` (a list of
token id lists), and optionally ``dimensions``; outputs ``embeddings`` (the vectors as
float32 little-endian bytes, ``count`` rows of ``dim``), ``dim``, ``count`` and
``prompt_tokens``. Bytes, not a list of floats: 384 floats as protobuf Values would be ten
times the size. ``dimensions`` is served as vLLM serves it: only by a model trained for
shortened vectors (``matryoshka_dimensions`` or ``is_matryoshka`` in its config.json), whose
vectors are cut to that many and normalised again; any other model refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from omniflow.api.common.v1 import common_pb2
from omniflow.api.worker.v1 import worker_pb2
from omniflow.errors import InvalidArgument
from omniflow.operations import operation
from omniflow.values import to_python

if TYPE_CHECKING:  # the role loads torch: the edge is imported by every worker
    from omniflow_services.worker.embed.role import EmbedRole

EMBED = operation("embed", "embed")
assert EMBED is not None


def _inputs(request: worker_pb2.InvokeRequest) -> tuple[list[str] | None, list[list[int]] | None]:
    given = dict(request.inputs)
    EMBED.check_input_names(given)
    if ("texts" in given) == ("token_ids" in given):
        raise InvalidArgument("embed takes one of inputs.texts or inputs.token_ids")
    if "texts" in given:
        texts = to_python(given["texts"])
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InvalidArgument("inputs.texts must be a list of strings")
        return texts, None
    ids = to_python(given["token_ids"])
    if not isinstance(ids, list) or not all(
        isinstance(x, tuple | list) and all(isinstance(t, int) for t in x) for x in ids
    ):
        raise InvalidArgument("inputs.token_ids must be a list of token id lists")
    return None, [list(x) for x in ids]


async def invoke_embed(
    role: EmbedRole, request: worker_pb2.InvokeRequest
) -> worker_pb2.InvokeResponse:
    """Serve ``embed.embed`` (``EMBED``, its entry in the table of operations)."""
    texts, ids = _inputs(request)
    dims = to_python(request.inputs["dimensions"]) if "dimensions" in request.inputs else None
    if dims is not None:
        role.check_dimensions(dims)
    done = await (role.embed_texts(texts) if texts is not None else role.embed_ids(ids or []))
    vectors = done.vectors if dims is None else role.shorten(done.vectors, dims)
    data = np.ascontiguousarray(vectors.numpy(), dtype="<f4").tobytes()
    count, dim = vectors.shape
    return worker_pb2.InvokeResponse(
        outputs={
            "embeddings": common_pb2.Value(bytes_value=data),
            "dim": common_pb2.Value(int_value=dim),
            "count": common_pb2.Value(int_value=count),
            "prompt_tokens": common_pb2.Value(int_value=done.prompt_tokens),
        }
    )
