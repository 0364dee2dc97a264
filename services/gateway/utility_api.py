"""vLLM's utility routes and the API's own description: ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``GET /openapi.json`` and ``GET /docs``; and
:func:`add_routes`, which registers these and the embeddings and audio routes on the app.

``/tokenize`` takes vLLM's two shapes: a ``prompt`` (tokenized as a completion prompt,
special tokens added unless ``add_special_tokens`` is false) or chat ``messages`` (rendered
with the model's chat template, as chat completions renders them, then tokenized without
adding special tokens again unless ``add_special_tokens``). It answers ``count``,
``max_model_len`` (the model's ``max_position_embeddings``), ``tokens`` and, asked for,
``token_strs`` (the vocabulary's strings). ``/detokenize`` decodes ``tokens`` with the
special tokens kept, as vLLM does. ``model`` may be left out when one llm model is served.

The OpenAPI document is FastAPI's, with the request bodies the handlers parse themselves
(their pydantic models) filled in, so that it lists the real request shapes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from omniflow.chat import Preprocessor
from omniflow_services.gateway.audio_api import AudioRoutes
from omniflow_services.gateway.core import GatewayCore, served_name
from omniflow_services.gateway.embeddings_api import EmbeddingsRoutes
from omniflow_services.gateway.endpoint_shapes import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TranscriptionRequest,
    TranslationRequest,
    VersionResponse,
)
from omniflow_services.gateway.errors import bad_request, from_validation, parse_json, the_one
from omniflow_services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageRequest,
    SpeechRequest,
)
from omniflow_services.gateway.replies import param_model
from omniflow_services.gateway.tool_calls import RESERVED_TEMPLATE_KWARGS

# Request bodies the handlers parse themselves: (path, content type, model(s)).
_BODIES: tuple[tuple[str, str, tuple[type[BaseModel], ...]], ...] = (
    ("/v1/chat/completions", "application/json", (ChatCompletionRequest,)),
    ("/v1/completions", "application/json", (CompletionRequest,)),
    ("/v1/images/generations", "application/json", (ImageRequest,)),
    ("/v1/audio/speech", "application/json", (SpeechRequest,)),
    ("/v1/embeddings", "application/json", (EmbeddingRequest,)),
    ("/v1/audio/transcriptions", "multipart/form-data", (TranscriptionRequest,)),
    ("/v1/audio/translations", "multipart/form-data", (TranslationRequest,)),
    ("/tokenize", "application/json", (TokenizeCompletionRequest, TokenizeChatRequest)),
    ("/detokenize", "application/json", (DetokenizeRequest,)),
)


def version() -> str:
    try:
        return metadata.version("omniflow")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "0+unknown"


def _message(m: Any, i: int) -> dict[str, Any]:
    """A tokenize request's message as the template renders it (text content only)."""
    out = m.model_dump(exclude_none=True)
    if out["role"] == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.get("type") != "text":
                raise bad_request(
                    f"messages[{i}].content[{j}] is {part.get('type')!r}: /tokenize renders "
                    "text content only",
                    f"messages[{i}].content",
                )
    return out


class UtilityRoutes:
    """The handlers of /tokenize, /detokenize and /version."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self._max_len: dict[Path, int] = {}

    async def _preprocessor(self, model: str | None) -> tuple[Preprocessor, str]:
        if model is None:
            served = {served_name(w) for w in await self.core.backends.workers() if w.role == "llm"}
            model = the_one(
                sorted(served),
                "model",
                "model is required: {count} llm models are served ({names})",
            )
        workers = await param_model(self.core.workers_for(model, "llm"))
        return await self.core.preprocessor(workers[0]), model

    def max_model_len(self, pre: Preprocessor) -> int:
        folder = Path(pre.folder)
        if folder not in self._max_len:
            cfg = json.loads((folder / "config.json").read_text())
            self._max_len[folder] = int(cfg.get("max_position_embeddings") or 0)
        return self._max_len[folder]

    async def tokenize(self, request: Request) -> Response:
        body = await request.body()
        try:
            raw = json.loads(body)
        except (ValueError, RecursionError):  # nested past Python's limit: not a request
            raise bad_request("the request body is not valid JSON") from None
        cls = TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw else None
        try:
            req = (cls or TokenizeCompletionRequest).model_validate(raw)
        except ValidationError as exc:
            raise from_validation(exc) from None
        pre, _ = await self._preprocessor(req.model)
        if isinstance(req, TokenizeChatRequest):
            messages = [_message(m, i) for i, m in enumerate(req.messages)]
            options: dict[str, Any] = {}
            if req.continue_final_message:
                if req.add_generation_prompt and "add_generation_prompt" in raw:
                    raise bad_request(
                        "continue_final_message and add_generation_prompt cannot both be true",
                        "continue_final_message",
                    )
                options["continue_final_message"] = True
            if req.tools:
                options["tools"] = req.tools
            if req.chat_template_kwargs:
                for key in req.chat_template_kwargs:
                    if key in RESERVED_TEMPLATE_KWARGS:
                        raise bad_request(
                            f"chat_template_kwargs.{key}: set it with the request's own field",
                            f"chat_template_kwargs.{key}",
                        )
                options["template_kwargs"] = req.chat_template_kwargs
            add_prompt = req.add_generation_prompt and not req.continue_final_message
            text = pre.render_chat(messages, add_prompt, **options)
            ids = pre.encode_text(text) if req.add_special_tokens else pre.encode_piece(text)
        elif req.add_special_tokens:
            ids = pre.encode_text(req.prompt)
        else:
            ids = pre.encode_piece(req.prompt)
        strs = None
        if req.return_token_strs:
            strs = [pre.tokenizer.id_to_token(t) for t in ids]
        out = TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len(pre), tokens=ids, token_strs=strs
        )
        return JSONResponse(out.model_dump())

    async def detokenize(self, request: Request) -> Response:
        req = await parse_json(request, DetokenizeRequest)
        pre, _ = await self._preprocessor(req.model)
        vocab = pre.tokenizer.get_vocab_size(with_added_tokens=True)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(
                    f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})", "tokens"
                )
        text = pre.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def version(self) -> Response:
        return JSONResponse(VersionResponse(version=version()).model_dump())


def _install_openapi(app: FastAPI) -> None:
    """FastAPI's document plus the request bodies of the handlers that parse their own."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=version(),
            description="OpenAI- and vLLM-compatible HTTP API of the Omni-Flow gateway",
            routes=app.routes,
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, media, models in _BODIES:
            op = doc.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            refs = []
            for cls in models:
                js = cls.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in js.pop("$defs", {}).items():
                    schemas.setdefault(name, sub)
                schemas[cls.__name__] = js
                refs.append({"$ref": f"#/components/schemas/{cls.__name__}"})
            schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
            op["requestBody"] = {"required": True, "content": {media: {"schema": schema}}}
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]


#: A POST handler that reads the raw request (its body parsed by the handler itself).
Handler = Callable[[Request], Awaitable[Response]]


def add_routes(app: FastAPI, core: GatewayCore) -> dict[str, Handler]:
    """Register the version and OpenAPI routes; the POST handlers of embeddings, audio to
    text and the tokenizer (path → handler) are returned, for the app to register with its
    own and the guard to call directly."""
    embeddings, audio, utility = EmbeddingsRoutes(core), AudioRoutes(core), UtilityRoutes(core)
    posts: dict[str, Handler] = {
        "/v1/embeddings": embeddings.embeddings,
        "/v1/audio/transcriptions": audio.transcriptions,
        "/v1/audio/translations": audio.translations,
        "/tokenize": utility.tokenize,
        "/detokenize": utility.detokenize,
    }
    app.add_api_route("/version", utility.version, methods=["GET"])
    _install_openapi(app)
    return posts
