"""Unit tests of the security library: certificates, tokens, settings, the policy table."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography import x509

from omniflow.api.coordinator.v1 import coordinator_pb2
from omniflow.api.kvagent.v1 import kvagent_pb2
from omniflow.api.kvindex.v1 import kvindex_pb2
from omniflow.api.router.v1 import router_pb2
from omniflow.api.worker.v1 import worker_pb2
from omniflow.cli.main import main as cli_main
from omniflow.config import SecuritySettings, SettingsError, load_settings
from omniflow.errors import InvalidArgument, NotFound, PermissionDenied
from omniflow.security import policy
from omniflow.security.bundle import make_bundle, parse_grant
from omniflow.security.identity import UNCHECKED, Identity, Principal, TokenTable
from omniflow.security.transport import Security, identity_of_pem

W1 = Identity("worker", "node-1", "w1")
W2 = Identity("worker", "node-2", "w2")
AGENT1 = Identity("kv-agent", "node-1", "a1")
AGENT2 = Identity("kv-agent", "node-2", "a2")
CLIENT = Identity("client", "laptop", "c")


def who(identity: Identity, tenant: str = "", *roles: str) -> Principal:
    return Principal(identity, tenant, frozenset(roles))


def test_certificates_carry_the_identity_and_keys_are_private(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "pki", [W1, CLIENT], ["acme:user", ":admin"])
    issued = bundle.certs[W1.uri]
    assert identity_of_pem(issued.cert.read_bytes()) == W1
    cert = x509.load_pem_x509_certificate(issued.cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(bundle.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    for path in (issued.key, bundle.folder / "ca.key", bundle.tokens_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    table = TokenTable.load(bundle.tokens_file)  # type: ignore[arg-type]
    grant = table.lookup(bundle.tokens["acme:user"])
    assert grant is not None and grant.tenant == "acme" and grant.roles == {"user"}
    assert table.lookup("x" * 43) is None
    # A second run keeps the CA (certificates issued before stay valid).
    again = make_bundle(tmp_path / "pki", [W2])
    assert again.ca.read_bytes() == bundle.ca.read_bytes()


def test_cli_certs_writes_the_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "pki"
    argv = ["certs", "--dir", str(folder), "--identity", "router/n/r1", "--token", "t:user"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["certs"]) == {"omniflow://router/n/r1"} and "t:user" in out["tokens"]
    assert cli_main(["certs", "--dir", str(folder), "--identity", "chef/n/x"]) == 2


def test_bad_identities_grants_and_token_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="identity kind 'chef'"):
        Identity("chef", "n", "i")
    with pytest.raises(InvalidArgument, match="without '/'"):
        Identity("worker", "n/1", "i")
    with pytest.raises(InvalidArgument, match="needs a tenant"):
        parse_grant(":user")
    with pytest.raises(InvalidArgument, match="accepted: admin, user"):
        parse_grant("t:root")
    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps({"tokens": [{"token": "short", "tenant": "t"}]}))
    with pytest.raises(InvalidArgument, match="at least 16 characters"):
        TokenTable.load(bad)
    bad.write_text(json.dumps({"tokens": [{"token": "x" * 20, "roles": ["user"]}]}))
    with pytest.raises(InvalidArgument, match="tenant is required"):
        TokenTable.load(bad)


def test_settings_fail_fast(tmp_path: Path) -> None:
    assert load_settings(SecuritySettings, env={}).tls == "off"
    with pytest.raises(SettingsError, match="OMNIFLOW_TLS_CA is required with OMNIFLOW_TLS=on"):
        load_settings(SecuritySettings, env={"OMNIFLOW_TLS": "on"}).check()
    with pytest.raises(SettingsError, match="OMNIFLOW_AUTH=on needs OMNIFLOW_TLS=on"):
        load_settings(SecuritySettings, env={"OMNIFLOW_AUTH": "on"}).check()
    with pytest.raises(SettingsError, match="no such file"):
        env = {"OMNIFLOW_TLS": "on", "OMNIFLOW_TLS_CA": str(tmp_path / "none.pem")}
        load_settings(
            SecuritySettings, env={**env, "OMNIFLOW_TLS_CERT": "x", "OMNIFLOW_TLS_KEY": "y"}
        ).check()
    # Reflection: on in development (plaintext), off once TLS is on unless asked for.
    assert Security(load_settings(SecuritySettings, env={})).reflection_on
    tls = SecuritySettings(tls="on")
    assert not Security(tls).reflection_on


def _method(module: object, service: str, name: str) -> str:
    full = module.DESCRIPTOR.services_by_name[service].full_name  # type: ignore[attr-defined]
    return f"/{full}/{name}"


def test_every_rpc_of_every_service_has_a_rule() -> None:
    table = policy.table()
    for module, service in (
        (kvindex_pb2, "KVIndexService"),
        (kvagent_pb2, "KVAgentService"),
        (router_pb2, "RouterService"),
        (worker_pb2, "WorkerService"),
        (coordinator_pb2, "CoordinatorService"),
    ):
        desc = module.DESCRIPTOR.services_by_name[service]
        assert set(table[desc.full_name]) == {m.name for m in desc.methods}, service
    assert policy.rule_for("/no.such.Service/Method") is policy.ADMIN


@pytest.mark.parametrize(
    ("method", "caller", "own", "allowed"),
    [
        # A kv-agent's pages: its node's workers, other agents pull; nobody else.
        (("kvagent", "PutPages"), who(W1), AGENT1, True),
        (("kvagent", "PutPages"), who(W2), AGENT1, False),
        (("kvagent", "PutPages"), who(CLIENT, "acme", "user"), AGENT1, False),
        (("kvagent", "Evict"), who(W2), AGENT1, False),
        (("kvagent", "Evict"), who(CLIENT, "", "admin"), AGENT1, True),
        (("kvagent", "GetPages"), who(AGENT2), AGENT1, True),
        (("kvagent", "GetPages"), who(W2), AGENT1, False),
        # Index: owners write, services probe, tenants do neither.
        (("kvindex", "PublishEvents"), who(W2), None, True),
        (("kvindex", "MatchPrefix"), who(CLIENT, "acme", "user"), None, False),
        (("kvindex", "MatchPrefix"), who(Identity("router", "n", "r")), None, True),
        # Breakers: only the router's clients; LoadModel: admins (or the router proxy).
        (("router", "ReportOutcome"), who(W1), None, False),
        (("router", "ReportOutcome"), who(Identity("gateway", "n", "g")), None, True),
        (("worker", "LoadModel"), who(CLIENT, "acme", "user"), None, False),
        (("worker", "LoadModel"), who(CLIENT, "", "admin"), None, True),
        (("worker", "Generate"), who(CLIENT, "acme", "user"), None, True),
        (("worker", "Generate"), who(CLIENT), None, False),  # a certificate, no token
        (("coordinator", "SubmitRun"), who(CLIENT, "acme", "user"), None, True),
    ],
)
def test_policy_table(method, caller, own, allowed) -> None:  # type: ignore[no-untyped-def]
    modules = {
        "kvagent": (kvagent_pb2, "KVAgentService"),
        "kvindex": (kvindex_pb2, "KVIndexService"),
        "router": (router_pb2, "RouterService"),
        "worker": (worker_pb2, "WorkerService"),
        "coordinator": (coordinator_pb2, "CoordinatorService"),
    }
    module, service = modules[method[0]]
    assert policy.rule_for(_method(module, service, method[1])).allows(caller, own) is allowed


def test_request_checks_on_the_current_caller() -> None:
    token = policy.set_current(who(W1))
    try:
        policy.require_owner("w1", "node-1")
        with pytest.raises(PermissionDenied, match="'a1' is not the caller's own identity"):
            policy.require_owner("a1")
        with pytest.raises(PermissionDenied, match="node 'node-2' is not the caller's node"):
            policy.require_owner("w1", "node-2")
    finally:
        policy.reset_current(token)
    token = policy.set_current(who(CLIENT, "acme", "user"))
    try:
        policy.require_tenant("acme", "run r")
        with pytest.raises(NotFound, match="run r not found"):
            policy.require_tenant("other", "run r")
        with pytest.raises(PermissionDenied, match="belongs to another tenant"):
            policy.require_may_change("other", "workflow w")
        policy.require_may_change(None, "workflow w")
    finally:
        policy.reset_current(token)
    # With auth off every check passes.
    assert policy.current() is UNCHECKED
    policy.require_owner("anyone")
    policy.require_tenant("other", "run r")
