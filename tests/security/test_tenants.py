"""Tenants without processes: API key tables, the KV salt of a tenant's block hashes,
the tenant forwarded on calls made while serving one, and `omniflow up`'s TLS switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniflow.chat.preprocess import Preprocessor
from omniflow.errors import InvalidArgument
from omniflow.kv.blocks import block_hashes, encode_extra_keys, item_id
from omniflow.security import local, policy
from omniflow.security.apikeys import ApiKeyTable, write_keys
from omniflow.security.identity import TENANT_HEADER, Identity, Principal
from omniflow.security.kvsalt import kv_salt, salted_extra_keys

NS = bytes(range(16))
PROMPT = list(range(40))  # two full pages of 16


def _as(tenant: str) -> object:
    who = Principal(Identity("gateway", "n", "gw"), tenant, frozenset({"user"}))
    return policy.set_current(who)


def test_a_tenants_block_hashes_are_its_own() -> None:
    plain = block_hashes(NS, PROMPT)
    a = block_hashes(NS, PROMPT, extra_keys=salted_extra_keys(None, "a"))
    b = block_hashes(NS, PROMPT, extra_keys=salted_extra_keys(None, "b"))
    assert len(plain) == len(a) == len(b) == 2
    assert not set(a) & set(b) and not set(a) & set(plain)  # no page in common at all
    assert a == block_hashes(NS, PROMPT, extra_keys=salted_extra_keys(None, "a"))  # stable
    assert salted_extra_keys(None, "") is None and kv_salt("") == b""  # tenant "": plain
    # A media item's keys on page 0 stay after the salt: still per item and per tenant.
    media = {0: encode_extra_keys([(item_id(b"png"), 3)])}
    salted = salted_extra_keys(media, "a")
    assert salted is not None and salted[0] == kv_salt("a") + media[0] and len(kv_salt("a")) == 32
    assert media[0] == encode_extra_keys([(item_id(b"png"), 3)])  # the caller's dict untouched


def test_the_caller_of_the_rpc_names_the_salt_and_is_forwarded() -> None:
    assert policy.forwarding_metadata() == ()  # outside a call: nothing
    token = _as("acme")
    try:
        assert policy.forwarding_metadata() == ((TENANT_HEADER, "acme"),)
        assert salted_extra_keys(None) == {0: kv_salt("acme")}
    finally:
        policy.reset_current(token)  # type: ignore[arg-type]
    assert salted_extra_keys(None) is None


def test_the_gateways_hashes_are_the_workers(tmp_path: Path) -> None:
    """The gateway and coordinator hash prompts with ``Preprocessor.block_hashes``; under
    a tenant they must equal the worker's salted hashes (kv_aware routing finds them)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    pre = Preprocessor.from_folder(tmp_path, NS, 16)
    token = _as("acme")
    try:
        assert pre.block_hashes(PROMPT) == block_hashes(NS, PROMPT, extra_keys={0: kv_salt("acme")})
    finally:
        policy.reset_current(token)  # type: ignore[arg-type]
    assert pre.block_hashes(PROMPT) == block_hashes(NS, PROMPT)


def test_api_key_table(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    write_keys(
        path,
        [
            {"key": "k" * 20, "tenant": "acme"},
            {"key": "a" * 20, "tenant": "ignored", "admin": True},
        ],
    )
    assert path.stat().st_mode & 0o777 == 0o600
    table = ApiKeyTable.load(path)
    assert len(table) == 2
    acme, admin = table.lookup("k" * 20), table.lookup("a" * 20)
    assert acme is not None and (acme.tenant, acme.admin) == ("acme", False)
    assert admin is not None and (admin.tenant, admin.admin) == ("", True)  # the shared tenant
    assert table.lookup("nope" * 5) is None
    for entries, error in (
        ([{"key": "short", "tenant": "x"}], "keys[0].key must be at least 16"),
        ([{"key": "k" * 20}], "keys[0].tenant is required"),
        ([{"key": "k" * 20, "tenant": "a/b"}], "no '/'"),
    ):
        path.write_text(json.dumps({"keys": entries}))
        with pytest.raises(InvalidArgument, match=error.replace("[", r"\[").replace("]", r"\]")):
            ApiKeyTable.load(path)
    path.write_text("[]")
    with pytest.raises(InvalidArgument, match="expected"):
        ApiKeyTable.load(path)


def test_up_is_secured_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNIFLOW_UP_TLS", raising=False)
    assert local.enabled()
    for off in ("off", "0", "false"):
        monkeypatch.setenv("OMNIFLOW_UP_TLS", off)
        assert not local.enabled()
    monkeypatch.setenv("OMNIFLOW_UP_TLS", "maybe")
    with pytest.raises(InvalidArgument, match=r"OMNIFLOW_UP_TLS='maybe'.*accepted: on/off"):
        local.enabled()
