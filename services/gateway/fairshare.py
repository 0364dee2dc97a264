"""Each tenant's share of the gateway: requests in flight and tokens per minute.

The gateway-wide bound (``OMNIFLOW_GATEWAY_MAX_IN_FLIGHT``) protects the gateway; these
protect tenants from each other: one tenant holding its ``tenant_max_in_flight`` requests
(stalled bodies, slow streams) or past its ``tenant_tokens_per_minute`` (prompt and
generated tokens of the last 60 s) gets 429 naming the limit, while every other tenant's
requests go on. Requests with no tenant of their own (no key table, or an admin key: the
shared tenant "") are bounded by the gateway-wide limit only. No HTTP here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0
#: A tenant's limits, in the order ``admit`` checks them: (the limit's short name, what the
#: tenant holds at it, its setting, when to retry).
_LIMITS = (
    ("tenant_in_flight", "has {} requests in flight", "OMNIFLOW_GATEWAY_TENANT_MAX_IN_FLIGHT",
     "retry when one ends"),
    ("tenant_tokens_per_minute", "used {} tokens in the last minute",
     "OMNIFLOW_GATEWAY_TENANT_TOKENS_PER_MINUTE", "retry later"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a tenant's request is refused: the message and the limit's short name."""

    message: str
    limit: str


@dataclass(slots=True)
class _Tenant:
    in_flight: int = 0
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens)
    total: int = 0  # the sum of ``tokens``


class TenantShare:
    """In-flight counts and a sliding minute of tokens per tenant (0 limits: off)."""

    def __init__(self, max_in_flight: int, tokens_per_minute: int) -> None:
        self.max_in_flight = max_in_flight
        self.tokens_per_minute = tokens_per_minute
        self._tenants: dict[str, _Tenant] = {}

    def _window(self, tenant: str, now: float) -> _Tenant:
        t = self._tenants.setdefault(tenant, _Tenant())
        while t.tokens and now - t.tokens[0][0] >= WINDOW_S:
            t.total -= t.tokens.popleft()[1]
        return t

    def admit(self, tenant: str) -> Refusal | None:
        """Take a slot for one request of ``tenant`` (``release`` gives it back), or say why
        not."""
        if not tenant:
            return None
        t = self._window(tenant, time.monotonic())
        values = ((self.max_in_flight, t.in_flight), (self.tokens_per_minute, t.total))
        for (name, held_as, setting, retry), (limit, held) in zip(_LIMITS, values, strict=True):
            if limit and held >= limit:
                return Refusal(
                    f"tenant {tenant!r} {held_as.format(held)}, its limit is {limit} "
                    f"({setting}); {retry}",
                    name,
                )
        t.in_flight += 1
        return None

    def release(self, tenant: str) -> None:
        t = self._tenants.get(tenant)
        if t is None:
            return
        t.in_flight = max(t.in_flight - 1, 0)
        if not t.in_flight and not t.tokens:
            del self._tenants[tenant]  # bounded by the tenants active now

    def spent(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` (prompt and generated) against ``tenant``'s minute."""
        if not tenant or not self.tokens_per_minute or tokens <= 0:
            return
        now = time.monotonic()
        t = self._window(tenant, now)
        t.tokens.append((now, tokens))
        t.total += tokens
