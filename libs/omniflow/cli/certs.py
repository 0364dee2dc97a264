"""``omniflow certs``: a local CA, a certificate per service identity, and caller tokens.

    omniflow certs --dir ~/.omniflow/pki \\
        --identity worker/node-1/llm-a --identity kv-agent/node-1/agent-1 \\
        --token acme:user --token ops:admin

writes ``ca.pem``, ``<kind>.<node>.<instance>.pem/.key`` (keys 0600) and ``tokens.json``
(0600; the servers' OMNIFLOW_TOKENS_FILE). ``--api-key acme`` (``:admin`` for an admin key)
also writes the gateway's key table ``gateway-keys.json`` (OMNIFLOW_GATEWAY_API_KEYS_FILE).
``--keep`` leaves a folder that already holds a CA and tokens as it is (a one-shot that
runs on every ``docker compose up``); ``--owner UID`` hands the files to the services' user.

    omniflow certs rotate [--dir FOLDER]

renews every service and client certificate in FOLDER (default: the ``pki/`` of the
``omniflow up`` topology of the run folder) with a new key, signed by the same CA, keeping
identities and names; running services take the new files at their next TLS handshake
(``Security.server_credentials``), without a restart and without losing a request.

    omniflow certs rotate --ca [--dir FOLDER] [--wait-s 10] [--step]

rotates the CA itself: a trust bundle of the old and a new CA, every certificate renewed
by the new CA, then the old CA dropped, ``--wait-s`` apart (``--step``: only the step due,
for an operator who spaces them out); see ``omniflow.security.ca_rotation``.
See docs/security.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.security import ca_rotation
from omniflow.security.apikeys import write_keys
from omniflow.security.bundle import TOKENS_FILE, make_bundle
from omniflow.security.certs import CA_CERT, renew_all
from omniflow.security.identity import Identity

GATEWAY_KEYS_FILE = "gateway-keys.json"


def add_subcommand(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "certs", help="make a local CA, service certificates and caller tokens; or rotate them"
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=("make", "rotate"),
        default="make",
        help="make (default) or rotate: renew every certificate in --dir, same CA",
    )
    p.add_argument(
        "--dir",
        type=Path,
        help="folder for the CA, certs and tokens (rotate: default the run folder's pki/)",
    )
    p.add_argument(
        "--identity",
        action="append",
        default=[],
        help="kind/node/instance (kinds: worker, kv-agent, kv-index, router, coordinator, "
        "gateway, client); repeat",
    )
    p.add_argument("--dns", action="append", default=[], help="extra host name in every cert")
    p.add_argument(
        "--token", action="append", default=[], help="tenant:role[,role] (roles: admin, user)"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a gateway API key for TENANT (':admin': an admin key); repeat",
    )
    p.add_argument(
        "--keep", action="store_true", help="do nothing when the folder has a CA and tokens"
    )
    p.add_argument("--owner", type=int, help="chown the folder and its files to this uid")
    p.add_argument(
        "--ca",
        action="store_true",
        help="rotate: the CA itself (trust old+new, renew by the new, drop the old)",
    )
    p.add_argument(
        "--wait-s", type=float, default=10.0, help="rotate --ca: seconds between its steps"
    )
    p.add_argument("--step", action="store_true", help="rotate --ca: only the step due now")


def _api_keys(folder: Path, specs: list[str]) -> dict[str, str]:
    """``tenant`` or ``:admin`` → a fresh key each, written to ``gateway-keys.json``."""
    keys: dict[str, str] = {}
    entries: list[dict[str, object]] = []
    for spec in specs:
        tenant, _, role = spec.partition(":")
        if role not in ("", "admin") or not (tenant or role):
            raise InvalidArgument(f"--api-key {spec!r}: expected TENANT or :admin")
        keys[spec] = secrets.token_urlsafe(32)
        entries.append({"key": keys[spec], "tenant": tenant, "admin": role == "admin"})
    write_keys(folder / GATEWAY_KEYS_FILE, entries)
    return keys


def rotate(folder: Path | None, ca: bool = False, wait_s: float = 10.0, one: bool = False) -> int:
    """``omniflow certs rotate [--ca]``: see the module docstring."""
    if folder is None:
        from omniflow.cli.local import run_dir
        from omniflow.security.local import PKI_DIR

        folder = run_dir() / PKI_DIR
    if not (folder / CA_CERT).is_file():
        raise InvalidArgument(f"no CA in {folder} ({CA_CERT}): nothing to rotate; see --dir")
    if ca:

        def report(done: str, renewed: list[str]) -> None:
            print(json.dumps({"folder": str(folder), "ca_step": done, "renewed": renewed}))

        if one:
            report(*ca_rotation.step(folder))
        else:
            ca_rotation.rotate_ca(folder, wait_s, report)
        return 0
    renewed = renew_all(folder)
    print(json.dumps({"folder": str(folder), "renewed": [c.identity.uri for c in renewed]}))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "rotate":
        return rotate(args.dir, args.ca, args.wait_s, args.step)
    if args.dir is None:
        raise InvalidArgument("omniflow certs: --dir is required (the folder to write)")
    if args.keep and (args.dir / "ca.pem").is_file() and (args.dir / TOKENS_FILE).is_file():
        print(json.dumps({"kept": str(args.dir)}))
        return 0
    identities = []
    for text in args.identity:
        parts = text.split("/")
        if len(parts) != 3:
            raise InvalidArgument(f"--identity {text!r}: expected kind/node/instance")
        identities.append(Identity(*parts))
    bundle = make_bundle(args.dir, identities, args.token, tuple(args.dns))
    api_keys = _api_keys(args.dir, args.api_key) if args.api_key else {}
    if args.owner is not None:
        for path in [args.dir, *args.dir.iterdir()]:
            os.chown(path, args.owner, -1)
    out = {
        "ca": str(bundle.ca),
        "certs": {u: {"cert": str(c.cert), "key": str(c.key)} for u, c in bundle.certs.items()},
        "tokens_file": str(bundle.tokens_file) if bundle.tokens_file else None,
        "tokens": bundle.tokens,
        "api_keys": api_keys,
    }
    print(json.dumps(out, indent=1))
    return 0
