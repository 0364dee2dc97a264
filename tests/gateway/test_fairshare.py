"""TenantShare without HTTP: each limit refuses with its own name and setting, only for the
tenant at it, and a slot given back (or a limit of 0) lets the next request in."""

from __future__ import annotations

from omniflow_services.gateway.fairshare import TenantShare


def _refused(share: TenantShare, tenant: str) -> tuple[str, str]:
    """(the limit's name, the message) of ``tenant``'s refusal; fails when it is admitted."""
    refusal = share.admit(tenant)
    assert refusal is not None, f"tenant {tenant!r} was admitted"
    return refusal.limit, refusal.message


def test_in_flight_limit_names_its_setting_and_frees_on_release() -> None:
    share = TenantShare(max_in_flight=2, tokens_per_minute=0)
    assert share.admit("a") is None and share.admit("a") is None
    assert _refused(share, "a") == (
        "tenant_in_flight",
        "tenant 'a' has 2 requests in flight, its limit is 2 "
        "(OMNIFLOW_GATEWAY_TENANT_MAX_IN_FLIGHT); retry when one ends",
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
    assert _refused(share, "a") == (
        "tenant_tokens_per_minute",
        "tenant 'a' used 100 tokens in the last minute, its limit is 100 "
        "(OMNIFLOW_GATEWAY_TENANT_TOKENS_PER_MINUTE); retry later",
    )
    assert share.admit("") is None  # the shared tenant is bounded gateway-wide only


def test_in_flight_is_checked_before_tokens() -> None:
    share = TenantShare(max_in_flight=1, tokens_per_minute=10)
    assert share.admit("a") is None
    share.spent("a", 10)
    assert _refused(share, "a")[0] == "tenant_in_flight"
