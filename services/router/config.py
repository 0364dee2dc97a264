"""Router settings: the pick policy's (``omniflow.routing.settings``) and the proxy's."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import setting
from omniflow.routing.settings import PickSettings


@dataclass(frozen=True, slots=True)
class RouterSettings(PickSettings):
    """Settings of the router (plus the pick policy's and the common ones)."""

    proxy_timeout_s: float = setting(
        "OMNIFLOW_ROUTER_PROXY_TIMEOUT_S",
        300.0,
        "deadline of proxied worker calls whose caller set none",
        minimum=0.001,
    )
