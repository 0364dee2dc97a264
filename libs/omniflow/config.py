"""Typed, frozen settings read from environment variables, with documented defaults.

Each service declares a frozen dataclass whose fields carry ``setting(env, default, help)``
metadata. ``load_settings`` reads the environment, applies overrides (from command-line
flags), converts every value to the field's type, and fails fast with a message that names
the variable, the bad value and what is accepted. ``settings_table`` renders the README's
table from the same declarations, so the docs cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


def setting(
    env: str,
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
) -> Any:
    """Declare one setting: its environment variable, default and help text."""
    meta = {"env": env, "help": help, "choices": choices, "minimum": minimum}
    return field(default=default, metadata=meta)


def peer_address(env: str, peer: str) -> Any:
    """Declare the address of a peer service (``host:port``). Empty, the default, means it
    is found through discovery (``omniflow.discovery.find_address(configured=...)``)."""
    return setting(env, "", f"{peer}; empty: found through discovery")


def _convert(raw: str, typ: Any, env: str) -> Any:
    origin = get_origin(typ)
    if origin in (types.UnionType,) or (origin is not None and type(None) in get_args(typ)):
        args = [a for a in get_args(typ) if a is not type(None)]
        if raw == "":
            return None
        return _convert(raw, args[0], env)
    if typ is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise SettingsError(
            f"{env}={raw!r} is not a boolean; accepted: on/off, 1/0, true/false, yes/no"
        )
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{env}={raw!r} is not an integer") from None
    if typ is float:
        try:
            return float(raw)
        except ValueError:
            raise SettingsError(f"{env}={raw!r} is not a number") from None
    if typ is Path:
        return Path(raw).expanduser()
    if typ is str:
        return raw
    if origin is tuple:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    raise SettingsError(f"{env}: unsupported setting type {typ!r}")


def load_settings(
    cls: type[T], env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> T:
    """Build ``cls`` from the environment; ``overrides`` (field name → value) win."""
    env = os.environ if env is None else env
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = f.metadata.get("env", f.name.upper())
        if f.name in overrides:
            value = overrides[f.name]
            if isinstance(value, str) and hints[f.name] is not str:
                value = _convert(value, hints[f.name], f"--{f.name.replace('_', '-')}")
        elif name in env:
            value = _convert(env[name], hints[f.name], name)
        else:
            continue
        choices = f.metadata.get("choices") or ()
        if choices and value not in choices:
            raise SettingsError(f"{name}={value!r} is not accepted; accepted: {', '.join(choices)}")
        minimum = f.metadata.get("minimum")
        if minimum is not None and isinstance(value, int | float) and value < minimum:
            raise SettingsError(f"{name}={value!r} is below the minimum {minimum}")
        values[f.name] = value
    return cls(**values)


def settings_table(*classes: type) -> str:
    """A Markdown table of every setting of ``classes`` (for the README)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    seen: set[str] = set()
    for cls in classes:
        for f in dataclasses.fields(cls):
            env = f.metadata.get("env")
            if not env or env in seen:
                continue
            seen.add(env)
            default = f.default if f.default is not dataclasses.MISSING else ""
            shown = "" if default is None else str(default)
            choices = f.metadata.get("choices")
            text = f.metadata.get("help", "")
            if choices:
                text += f" ({' / '.join(choices)})"
            rows.append(f"| `{env}` | `{shown}` | {text} |")
    return "\n".join(rows)


@dataclass(frozen=True, slots=True)
class CommonSettings:
    """Settings every service reads."""

    host: str = setting("OMNIFLOW_HOST", "127.0.0.1", "address the gRPC server binds")
    port: int = setting("OMNIFLOW_PORT", 0, "gRPC port; 0 picks a free one", minimum=0)
    advertise_host: str = setting(
        "OMNIFLOW_ADVERTISE_HOST",
        "",
        "host others use to reach this service; empty: bind host "
        "(or the hostname when binding 0.0.0.0)",
    )
    instance_id: str = setting("OMNIFLOW_INSTANCE_ID", "", "unique id; empty: service-host-pid")
    node_id: str = setting("OMNIFLOW_NODE_ID", "", "node (machine) id; empty: the hostname")
    discovery: str = setting(
        "OMNIFLOW_DISCOVERY", "redis", "discovery backend", choices=("redis", "consul", "static")
    )
    redis_url: str = setting(
        "OMNIFLOW_REDIS_URL",
        "redis://127.0.0.1:6379/0",
        "Redis URL; `omniflow up` starts its own Redis unless it is set",
    )
    consul_addr: str = setting("CONSUL_HTTP_ADDR", "127.0.0.1:8500", "Consul HTTP API address")
    consul_token: str = setting("CONSUL_HTTP_TOKEN", "", "Consul ACL token")
    consul_check: str = setting(
        "OMNIFLOW_CONSUL_CHECK", "ttl", "Consul health check kind", choices=("ttl", "grpc")
    )
    static_file: str = setting("OMNIFLOW_STATIC_FILE", "", "service file of the static backend")
    registration_ttl_s: float = setting(
        "OMNIFLOW_REGISTRATION_TTL_S",
        5.0,
        "registration time to live; refreshed at a third",
        minimum=0.5,
    )
    metrics_port: int = setting(
        "OMNIFLOW_METRICS_PORT", 0, "Prometheus HTTP port; 0 picks a free one, -1 disables"
    )
    max_concurrent_rpcs: int = setting(
        "OMNIFLOW_MAX_CONCURRENT_RPCS",
        512,
        "RPCs served at once; more get RESOURCE_EXHAUSTED",
        minimum=1,
    )
    call_timeout_s: float = setting(
        "OMNIFLOW_CALL_TIMEOUT_S", 10.0, "deadline of outgoing calls that set none", minimum=0.001
    )
    shutdown_grace_s: float = setting(
        "OMNIFLOW_SHUTDOWN_GRACE_S", 5.0, "grace period for in-flight RPCs on shutdown", minimum=0
    )
    log_level: str = setting(
        "OMNIFLOW_LOG_LEVEL",
        "INFO",
        "log level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    )
    ready_file: str = setting(
        "OMNIFLOW_READY_FILE", "", "when set, a JSON file written once the service is SERVING"
    )

    def resolved_node(self) -> str:
        return self.node_id or socket.gethostname()

    def resolved_advertise_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", "[::]"):
            return socket.gethostname()
        return self.host


def settings_from_argv(cls: type[T], argv: list[str] | None, description: str) -> T:
    """Settings from the environment, with every field also a ``--flag`` that overrides it.

    Exits with status 2 and a message naming the variable when a value is bad.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        env = f.metadata.get("env", f.name.upper())
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=None,
            help=f"{f.metadata.get('help', '')} [env {env}, default {f.default!r}]",
        )
    args = parser.parse_args(argv)
    try:
        return load_settings(cls, overrides=vars(args))
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """Transport security and caller authentication, read once per process (every server
    and channel of the process uses them; see docs/security.md)."""

    tls: str = setting(
        "OMNIFLOW_TLS",
        "off",
        "mutual TLS on every server and channel; off: plaintext (development only)",
        choices=("on", "off"),
    )
    tls_ca: str = setting("OMNIFLOW_TLS_CA", "", "CA certificate (PEM) that signs every peer")
    tls_cert: str = setting(
        "OMNIFLOW_TLS_CERT", "", "this process's certificate (PEM; its URI SAN is its identity)"
    )
    tls_key: str = setting("OMNIFLOW_TLS_KEY", "", "this process's private key (PEM, mode 0600)")
    auth: str = setting(
        "OMNIFLOW_AUTH",
        "off",
        "check every RPC against the policy table (needs OMNIFLOW_TLS=on)",
        choices=("on", "off"),
    )
    tokens_file: str = setting(
        "OMNIFLOW_TOKENS_FILE", "", "servers: JSON file of caller tokens (token → tenant, roles)"
    )
    token: str = setting(
        "OMNIFLOW_TOKEN", "", "clients: the token this process presents (authorization: Bearer)"
    )
    reflection: str = setting(
        "OMNIFLOW_REFLECTION",
        "dev",
        "gRPC server reflection; dev: only when OMNIFLOW_TLS=off",
        choices=("dev", "on", "off"),
    )

    @property
    def tls_on(self) -> bool:
        return self.tls == "on"

    @property
    def auth_on(self) -> bool:
        return self.auth == "on"

    def check(self) -> SecuritySettings:
        """Fail fast on a configuration that cannot work; returns self."""
        if self.tls_on:
            for env, value in (
                ("OMNIFLOW_TLS_CA", self.tls_ca),
                ("OMNIFLOW_TLS_CERT", self.tls_cert),
                ("OMNIFLOW_TLS_KEY", self.tls_key),
            ):
                if not value:
                    raise SettingsError(f"{env} is required with OMNIFLOW_TLS=on")
                if not Path(value).is_file():
                    raise SettingsError(f"{env}={value!r}: no such file")
        if self.auth_on and not self.tls_on:
            raise SettingsError(
                "OMNIFLOW_AUTH=on needs OMNIFLOW_TLS=on (identities come from certificates)"
            )
        return self


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """OpenTelemetry's own variables, as its SDK defines them (``omniflow.telemetry`` reads
    them once per process; the OTLP exporter reads its endpoint itself)."""

    traces_exporter: str = setting(
        "OTEL_TRACES_EXPORTER",
        "",
        "span exporter: otlp, console or none; empty: otlp when an OTLP endpoint is set",
    )
    traces_endpoint: str = setting(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "", "where OTLP spans go (gRPC)"
    )
    endpoint: str = setting(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "", "OTLP endpoint when the traces one is unset"
    )
    sdk_disabled: str = setting("OTEL_SDK_DISABLED", "", "true: no tracing SDK in the process")
    service_name: str = setting(
        "OTEL_SERVICE_NAME", "", "service name on the spans; empty: the service's own"
    )
    propagators: str = setting(
        "OTEL_PROPAGATORS",
        "",
        "set: the SDK's configured propagators; empty: W3C trace context only (cheaper)",
    )


@dataclass(frozen=True, slots=True)
class LocalSettings:
    """What ``omniflow up`` and the clients started on this machine (the CLI, ``Client``)
    read: the run folder and where the coordinator is. The last three are variables the
    services declare too, read here only to know whether the user gave them."""

    run_dir: str = setting(
        "OMNIFLOW_RUN_DIR",
        ".omniflow/run",
        "run folder of `omniflow up` (state, logs, pki); clients find the topology there",
    )
    coordinator_addr: str = setting(
        "OMNIFLOW_COORDINATOR_ADDR",
        "",
        "clients: coordinator addresses (comma-separated); empty: those the run folder records",
    )
    supervise: bool = setting(
        "OMNIFLOW_SUPERVISE", True, "`omniflow up` starts the supervisor that restarts the dead"
    )
    up_tls: bool = setting(
        "OMNIFLOW_UP_TLS",
        True,
        "`omniflow up` turns mutual TLS and auth on; off: plaintext (development only)",
    )
    redis_url: str = setting("OMNIFLOW_REDIS_URL", "", "`omniflow up`: empty starts its own Redis")
    tls: str = setting("OMNIFLOW_TLS", "", "set: the process configures its security itself")
    gateway_api_keys_file: str = setting(
        "OMNIFLOW_GATEWAY_API_KEYS_FILE", "", "set: the gateway's keys are the user's"
    )


def local_settings() -> LocalSettings:
    """:class:`LocalSettings` from the environment as it is now (read at each call: the
    CLI and tests change ``OMNIFLOW_RUN_DIR`` between calls)."""
    return load_settings(LocalSettings)
