"""Unit tests (no network): the request counts' route labels come from the app's own routes,
and ``the_one`` names what it found."""

from __future__ import annotations

import types

import pytest

from omniflow_services.gateway.app import build_app
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.gateway.errors import APIError, the_one


def test_every_fixed_path_has_its_label() -> None:
    # The app only stores the core while it is built (the handlers use it per request).
    guard = build_app(GatewaySettings(), types.SimpleNamespace(), lambda: True)  # type: ignore[arg-type]
    assert guard.routes == {
        "/health": "health",
        "/metrics": "metrics",
        "/v1/models": "models",
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/images/generations": "images",
        "/v1/audio/speech": "speech",
        "/v1/embeddings": "embeddings",
        "/v1/audio/transcriptions": "transcriptions",
        "/v1/audio/translations": "translations",
        "/tokenize": "tokenize",
        "/detokenize": "detokenize",
        "/version": "version",
        "/openapi.json": "openapi",
        "/docs": "docs",
    }


def test_the_one_returns_it_or_names_what_there_was() -> None:
    assert the_one(["a"], "p", "{count}: {names}") == "a"
    with pytest.raises(APIError) as none:
        the_one([], "model", "{count} served ({names})")
    assert (none.value.status, none.value.message, none.value.param) == (
        400,
        "0 served (none)",
        "model",
    )
    with pytest.raises(APIError) as two:
        the_one(["a", "b"], "so", "got {names}")
    assert two.value.message == "got a, b"
