"""The HTTP edge: a FastAPI app over the gateway core, and the guard every request passes.

The guard (a plain ASGI middleware, cheaper than Starlette's BaseHTTPMiddleware) gives
every response an ``x-request-id``, checks the optional API key, bounds the requests in
flight (429 past it) and the body size (413), and counts requests by route and status.
With a key table (``OMNIFLOW_GATEWAY_API_KEYS_FILE``, ``omniflow.security.apikeys``) the
key names the request's tenant: it is the caller of every gRPC call made for the request
(``security.policy.current``), which forwards it to the coordinator, router and workers.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniflow.errors import OmniflowError
from omniflow.security import policy
from omniflow.security.apikeys import ApiKeyTable
from omniflow.security.identity import Principal
from omniflow.security.transport import state as security_state
from omniflow_services.gateway import access, metrics
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.core import GatewayCore, new_id
from omniflow_services.gateway.errors import APIError, from_domain
from omniflow_services.gateway.fairshare import TenantShare
from omniflow_services.gateway.openai_api import OpenAIRoutes
from omniflow_services.gateway.protocol import error_body
from omniflow_services.gateway.utility_api import Handler, add_routes

log = logging.getLogger(__name__)

# No API key, no in-flight bound. The API's description is open as vLLM's server leaves it
# (its key guards /v1 only): the document lists shapes, never data.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs")


def route_labels(app: FastAPI) -> dict[str, str]:
    """Each fixed path of ``app`` → its label in the request counts: an API route's name
    (its handler's, unless the route names another), "openapi" and "docs" for FastAPI's own
    pages. Paths with parameters are not listed (the guard labels /v1/models/{id} itself)."""
    labels = {r.path: r.name for r in app.routes if isinstance(r, APIRoute) and "{" not in r.path}
    for path, label in ((app.openapi_url, "openapi"), (app.docs_url, "docs")):
        if path is not None:
            labels[path] = label
    return labels


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code), err.status, headers=headers
    )


class Guard:
    """Request id, API key, body size, in-flight bound and request counts."""

    def __init__(
        self,
        app: ASGIApp,
        settings: GatewaySettings,
        routes: dict[str, str],
        direct: dict[str, Handler] | None = None,
    ) -> None:
        self.app = app
        self.routes = routes  # path → route label (``route_labels``)
        #: POST path → its handler, called here (``serve_direct``), not through ``app``.
        self.direct = direct or {}
        self.key = settings.api_key.encode()
        keys_file = settings.api_keys_file
        # Read again when the file changes: a removed key stops working within a second.
        self._keys = ApiKeyTable.watch(Path(keys_file)) if keys_file else None
        self.identity = security_state().identity  # the gateway's own (None with TLS off)
        self.max_body = settings.max_body_bytes
        self.max_in_flight = settings.max_in_flight
        self.in_flight = 0
        #: Each tenant's share of the requests in flight and of the tokens per minute.
        self.share = TenantShare(settings.tenant_max_in_flight, settings.tenant_tokens_per_minute)

    @property
    def keys(self) -> ApiKeyTable | None:
        return self._keys.current() if self._keys is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        route = self.routes.get(path, "models" if path.startswith("/v1/models/") else "other")
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")[:128]
        rid = new_id("req")
        scope.setdefault("state", {}).update(request_id=rid, arrived=time.perf_counter())
        echo = (b"x-request-id", (given or rid).encode("latin-1"))
        status = [500]
        entry = access.Entry(scope.get("method", ""), path, given or rid)
        logged = access.begin(entry)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), echo]
            await send(message)

        try:
            err = self._check(path, headers)
            if err is not None:
                await error_response(err)(scope, receive, send_with_id)
                return
            if path in OPEN_PATHS:
                await self.app(scope, receive, send_with_id)
                return
            if self.in_flight >= self.max_in_flight:
                err = APIError(
                    429,
                    f"the gateway is at capacity ({self.max_in_flight} requests in flight, "
                    "OMNIFLOW_GATEWAY_MAX_IN_FLIGHT); retry later",
                    "rate_limit_error",
                    None,
                    "at_capacity",
                )
                await error_response(err)(scope, receive, send_with_id)
                return
            self.in_flight += 1
            metrics.IN_FLIGHT.inc()
            caller = self._caller(headers)
            entry.tenant = caller.tenant
            refused = self.share.admit(caller.tenant)
            if refused is not None:
                self.in_flight -= 1
                metrics.IN_FLIGHT.dec()
                metrics.REFUSED.labels(refused.limit).inc()
                err = APIError(429, refused.message, "rate_limit_error", None, refused.limit)
                await error_response(err)(scope, receive, send_with_id)
                return
            acting = policy.set_current(caller)
            try:
                handler = self.direct.get(path) if scope.get("method") == "POST" else None
                if handler is not None:
                    await serve_direct(handler, scope, self._bounded(receive), send_with_id)
                else:
                    await self.app(scope, self._bounded(receive), send_with_id)
            finally:
                policy.reset_current(acting)
                self.share.release(caller.tenant)
                self.in_flight -= 1
                metrics.IN_FLIGHT.dec()
        finally:
            metrics.REQUESTS.labels(route, str(status[0])).inc()
            arrived = scope["state"]["arrived"]
            access.end(logged, entry, status[0], (time.perf_counter() - arrived) * 1e3)

    def _caller(self, headers: dict[bytes, bytes]) -> Principal:
        """Whom the request acts for: the tenant of its key (checked by ``_check``), or the
        gateway itself (no key table, or an admin key: the shared tenant "")."""
        grant = self.keys.lookup(_bearer(headers).decode("latin-1")) if self.keys else None
        if grant is None or not grant.tenant:
            return policy.current()
        return Principal(self.identity, grant.tenant, frozenset({"user"}))

    def _check(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if (self.key or self.keys is not None) and path not in OPEN_PATHS:
            token = _bearer(headers)
            in_table = self.keys is not None and self.keys.lookup(token.decode("latin-1"))
            matches = bool(self.key) and hmac.compare_digest(token, self.key)
            if not token or not (in_table or matches):
                return APIError(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer <key>`",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body is larger than {self.max_body} bytes (OMNIFLOW_GATEWAY_MAX_BODY_BYTES)",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    def _bounded(self, receive: Receive) -> Callable[[], Awaitable[Message]]:
        # A chunked body has no Content-Length: count what arrives.
        seen = [0]

        async def bounded() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:
                    raise self._too_large()
            return message

        return bounded


async def serve_direct(handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
    """One request to ``handler`` without FastAPI's routing and middleware stack, which the
    handlers that take the raw request and parse their body themselves do not use (each
    layer wraps every send of a stream; bench/serve_openai.py --parts overhead measures the
    gateway's cost). Errors get the one OpenAI shape, as FastAPI's exception handlers
    give it; an unexpected one is logged and answered 500."""
    try:
        response = await handler(Request(scope, receive))
    except APIError as exc:
        response = error_response(exc)
    except OmniflowError as exc:
        response = error_response(from_domain(exc))
    except Exception:
        log.exception("%s %s failed", scope.get("method"), scope.get("path"))
        response = error_response(
            APIError(500, "internal error (the gateway's log has it)", "server_error", None, None)
        )
    await response(scope, receive, send)


def _bearer(headers: dict[bytes, bytes]) -> bytes:
    """The key of ``Authorization: Bearer <key>`` (b"" when absent or another scheme)."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def build_app(settings: GatewaySettings, core: GatewayCore, serving: Callable[[], bool]) -> ASGIApp:
    """The ASGI app: routes, one error shape, wrapped in the guard."""
    app = FastAPI(
        title="Omni-Flow gateway", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json"
    )
    api = OpenAIRoutes(settings, core)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(OmniflowError)
    async def _domain_error(request: Request, exc: OmniflowError) -> JSONResponse:
        return error_response(from_domain(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = str(exc.detail)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, detail, type_, None, None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, str(exc), "invalid_request_error", None, None))

    @app.get("/health")
    async def health() -> Response:
        ok = serving()
        return JSONResponse({"status": "ok" if ok else "starting or stopping"}, 200 if ok else 503)

    @app.get("/metrics", name="metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return await api.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await api.model(model_id)

    # The POST handlers take the raw request: they parse the body themselves, so that a bad
    # one is OpenAI's 400 naming the field. The guard calls them itself (``serve_direct``);
    # their routes here give the API document and the route labels.
    direct: dict[str, Handler] = {
        "/v1/chat/completions": api.chat,
        "/v1/completions": api.completions,
        "/v1/images/generations": api.images,
        "/v1/audio/speech": api.speech,
    }
    direct |= add_routes(app, core)  # embeddings, audio to text, tokenize; version, OpenAPI
    for path, handler in direct.items():
        app.add_api_route(path, handler, methods=["POST"])

    guard = Guard(app, settings, route_labels(app), direct)
    core.share = guard.share  # the core counts each tenant's tokens into it
    return guard


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
