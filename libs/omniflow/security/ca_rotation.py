"""Rotating the CA itself, in three steps, without losing a request.

Every process reads ``ca.pem`` as its trust roots and takes the file again when it changes
(a server at its next TLS handshake, a process's new channels when they are made:
``Security.reload_tls``), and ``ca.pem`` may hold several certificates (a trust bundle).

1. **trust**: a new CA is made (``ca-next.pem`` / ``ca-next.key``) and ``ca.pem`` becomes
   the bundle old + new. Every certificate is still the old CA's; from now on a handshake
   trusts either CA.
2. **renew**: every identity certificate of the folder gets a new key and a certificate of
   the new CA (identities and names kept). A peer that still presents an old certificate
   is trusted (the bundle), and so is one that presents a new one.
3. **drop**: ``ca.pem`` is the new CA alone and ``ca.key`` its key; the old CA is gone.
   Every certificate of the folder is the new CA's.

Between the steps the processes must have taken the files: ``rotate_ca`` waits ``wait_s``
between them (default 10 s; their file checks are per handshake and per new channel).
TLS connections already open keep the session they negotiated, so no call in flight is
lost; what a step cannot reach is a channel made before step 1 that reconnects after step 3
(it trusts the old CA only): processes restarted by the supervisor, and every new channel,
read the files afresh. Each step is idempotent: ``next_step`` says which one is due from
what the folder holds, so an interrupted rotation is resumed by running it again.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from omniflow.errors import InvalidArgument
from omniflow.security.certs import (
    CA_CERT,
    CA_KEY,
    CA_NEXT_CERT,
    CA_NEXT_KEY,
    _write_private,
    identity_certs,
    make_ca,
    renew_all,
)

STEPS = ("trust", "renew", "drop")


def _certs(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def next_step(folder: Path) -> str:
    """The step of a CA rotation due in ``folder``: ``trust`` when none is under way."""
    if not (folder / CA_CERT).is_file() or not (folder / CA_KEY).is_file():
        raise InvalidArgument(f"no CA in {folder} ({CA_CERT}, {CA_KEY}): nothing to rotate")
    if not (folder / CA_NEXT_CERT).is_file():
        return "trust"
    nxt = _certs(folder / CA_NEXT_CERT)[0].subject
    for cert_path in identity_certs(folder):
        if _certs(cert_path)[0].issuer != nxt:
            return "renew"
    return "drop"


def step(folder: Path) -> tuple[str, list[str]]:
    """Do the step due (see the module docstring); returns it and the identities renewed."""
    due = next_step(folder)
    renewed: list[str] = []
    if due == "trust":
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
        # A name of its own: two CAs of one name in a bundle confuse chain building.
        make_ca(folder / CA_NEXT_CERT, folder / CA_NEXT_KEY, f"omniflow local CA {stamp}")
        bundle = (folder / CA_CERT).read_bytes().rstrip(b"\n") + b"\n"
        _write_private(folder / CA_CERT, bundle + (folder / CA_NEXT_CERT).read_bytes())
    elif due == "renew":
        issued = renew_all(folder, (folder / CA_NEXT_CERT, folder / CA_NEXT_KEY))
        renewed = [c.identity.uri for c in issued]
    else:
        # The key first: a process reading ca.pem again signs nothing; only the CLI does.
        _write_private(folder / CA_KEY, (folder / CA_NEXT_KEY).read_bytes())
        _write_private(folder / CA_CERT, (folder / CA_NEXT_CERT).read_bytes())
        (folder / CA_NEXT_KEY).unlink()
        (folder / CA_NEXT_CERT).unlink()
    return due, renewed


def rotate_ca(
    folder: Path, wait_s: float = 10.0, report: Callable[[str, list[str]], None] | None = None
) -> None:
    """Every step still due, ``wait_s`` apart (the processes take each before the next)."""
    while True:
        done, renewed = step(folder)
        if report is not None:
            report(done, renewed)
        if done == "drop":
            return
        time.sleep(wait_s)
