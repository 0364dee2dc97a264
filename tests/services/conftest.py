"""Fixtures for multi-process service tests: ``spawn("router", name, **env)`` starts
``python -m omniflow_services.router`` through the shared ``launch`` fixture."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def spawn(launch: Callable[..., object]) -> Callable[..., object]:
    def start(module: str, name: str | None = None, **env: str) -> object:
        return launch(f"omniflow_services.{module}", name or module, **env)

    return start
