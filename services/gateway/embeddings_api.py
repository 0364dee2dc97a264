"""``POST /v1/embeddings``: texts or token ids → an ``embed`` worker's pooled vectors.

The input is OpenAI's: a string, a list of strings, a list of token ids, or a list of
token id lists. Strings go to the worker as they are (it tokenizes them with the model's
tokenizer: an embedding has no KV pages and no prompt hashes to route by, so tokenizing
there costs the gateway nothing); token ids go as given. ``encoding_format`` ``float``
gives lists of numbers, ``base64`` the little-endian float32 bytes in base64 (what the
``openai`` client asks for by default and decodes). ``dimensions`` other than the
model's own is a 400: a model that was not trained for shortened vectors (matryoshka)
would return poor ones.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omniflow.values import Tokens
from omniflow_services.gateway import metrics
from omniflow_services.gateway.core import GatewayCore
from omniflow_services.gateway.endpoint_shapes import (
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
)
from omniflow_services.gateway.errors import bad_request, parse_json
from omniflow_services.gateway.replies import param_model, whole

ROLE = "embed"
OPERATION = "embed"


def embed_inputs(given: str | list[str] | list[int] | list[list[int]]) -> dict[str, object]:
    """The worker's inputs for OpenAI's ``input``: ``texts`` or ``token_ids``."""
    if isinstance(given, str):
        given = [given]
    if not given:
        raise bad_request("input is empty: send a string, strings, or token ids", "input")
    if all(isinstance(x, str) for x in given):
        for i, x in enumerate(given):
            if not x:
                raise bad_request(f"input[{i}] is an empty string", "input")
        return {"texts": list(given)}
    if all(isinstance(x, int) for x in given):
        return {"token_ids": [Tokens(given)]}  # type: ignore[arg-type]
    lists = []
    for i, x in enumerate(given):
        if not isinstance(x, list) or not x:
            raise bad_request(f"input[{i}] is an empty token list", "input")
        lists.append(Tokens(x))
    return {"token_ids": lists}


class EmbeddingsRoutes:
    """The handler of ``/v1/embeddings``."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def embeddings(self, request: Request) -> Response:
        req = await parse_json(request, EmbeddingRequest)
        inputs = embed_inputs(req.input)
        if req.dimensions is not None:
            inputs["dimensions"] = req.dimensions
        arrived = request.state.arrived
        out = await whole(
            request, param_model(self.core.invoke(req.model, ROLE, OPERATION, inputs))
        )
        if out is None:
            return Response(status_code=499)
        count, dim = int(out["count"]), int(out["dim"])
        vectors = np.frombuffer(out["embeddings"], dtype="<f4").reshape(count, dim)
        data = [
            Embedding(
                index=i,
                embedding=base64.b64encode(v.tobytes()).decode()
                if req.encoding_format == "base64"
                else v.astype(float).tolist(),
            )
            for i, v in enumerate(vectors)
        ]
        tokens = int(out["prompt_tokens"])
        metrics.PROMPT_TOKENS.labels("embeddings").inc(tokens)
        metrics.E2E.labels("embeddings").observe(time.perf_counter() - arrived)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        body = EmbeddingList(data=data, model=req.model, usage=usage)
        return JSONResponse(body.model_dump())
