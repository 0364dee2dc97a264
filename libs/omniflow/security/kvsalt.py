"""A tenant's KV pages are its own: its prompts' block hashes are salted with the tenant.

The salt goes before page 0's extra keys (``omniflow.kv.blocks``), so the whole chain of a
tenant's block hashes differs from every other tenant's: a cached prompt of one tenant is
never a hit, nor a probe, for another. Tenant ``""`` (services, admins, auth off) has no
salt: its hashes are the plain ones. The tenant defaults to the caller of the RPC being
served (``policy.current``), which the gateway sets from its API key and the forwarding
services pass on (``x-omniflow-tenant``).
"""

from __future__ import annotations

import hashlib

from omniflow.security import policy

_SALT_PERSON = b"omniflow-tenant"


def kv_salt(tenant: str) -> bytes:
    """The extra key that page 0 of a tenant's prompt hashes with ("" for tenant ""): the
    whole chain of block hashes then differs per tenant, so one tenant's cached pages
    are never a hit (nor a probe) for another. 32 bytes, so it can never parse as
    multimodal extra keys (20-byte records, ``blocks.encode_extra_keys``)."""
    if not tenant:
        return b""
    return hashlib.blake2b(tenant.encode(), digest_size=32, person=_SALT_PERSON).digest()


def salted_extra_keys(
    extra_keys: dict[int, bytes] | None, tenant: str | None = None
) -> dict[int, bytes] | None:
    """``extra_keys`` (page index → bytes) with the tenant's salt before page 0's;
    ``tenant`` defaults to the caller of the RPC being served."""
    salt = kv_salt(policy.caller_tenant() if tenant is None else tenant)
    if not salt:
        return extra_keys
    out = dict(extra_keys or {})
    out[0] = salt + out.get(0, b"")
    return out
