"""TenantShare without HTTP: each limit refuses with its own name and setting, only for the
tenant at it, and a slot given back (or a limit of 0) lets the next request in."""

from __future__ import annotations

from omniflow_services.gateway.fairshare import TenantShare


def test_in_flight_limit_names_its_setting_and_frees_on_release() -> None:
    share = TenantShare(max_in_flight=2, tokens_per_minute=0)
    assert share.admit("a") is None and share.admit("a") is None
    refused = share.admit("a")
    assert refused is not None
    assert refused.limit == "tenant_in_flight"
    assert refused.message == (
        "tenant 'a' has 2 requests in flight, its limit is 2 "
        "(OMNIFLOW_GATEWAY_TENANT_MAX_IN_FLIGHT); retry when one ends"
    )
    assert share.admit("b") is None  # another tenant is not held back
    share.release("a")
    assert share.admit("a") is None


def test_tokens_per_minute_limit_names_its_setting() -> None:
    share = TenantShare(max_in_flight=0, tokens_per_minute=100)
    assert share.admit("a") is None
    share.spent("a", 60)
    assert share.admit("a") is None
    share.spent("a", 40)
    refused = share.admit("a")
    assert refused is not None
    assert refused.limit == "tenant_tokens_per_minute"
    assert refused.message == (
        "tenant 'a' used 100 tokens in the last minute, its limit is 100 "
        "(OMNIFLOW_GATEWAY_TENANT_TOKENS_PER_MINUTE); retry later"
    )
    assert share.admit("") is None  # the shared tenant is bounded gateway-wide only


def test_in_flight_is_checked_before_tokens() -> None:
    share = TenantShare(max_in_flight=1, tokens_per_minute=10)
    assert share.admit("a") is None
    share.spent("a", 10)
    refused = share.admit("a")
    assert refused is not None and refused.limit == "tenant_in_flight"
