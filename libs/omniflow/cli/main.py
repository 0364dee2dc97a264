"""``omniflow``: run the local topology, make models, inspect settings."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path

from omniflow.cli import certs as certs_cli
from omniflow.cli import deploy as deploy_cli
from omniflow.cli import workflow as workflow_cli
from omniflow.config import (
    CommonSettings,
    LocalSettings,
    SecuritySettings,
    TelemetrySettings,
    settings_table,
)
from omniflow.errors import OmniflowError
from omniflow.logsetup import setup_logging

# Where each service's settings class lives. Imported only when the table is printed, so
# that the CLI imports no service (an install may carry only some of them).
SERVICE_SETTINGS: dict[str, str] = {
    "router": "omniflow_services.router.config:RouterSettings",
    "coordinator": "omniflow_services.coordinator.config:CoordinatorSettings",
    "kv-index": "omniflow_services.kv_index.config:KVIndexSettings",
    "kv-agent": "omniflow_services.kv_agent.config:KVAgentSettings",
    "worker": "omniflow_services.worker.config:WorkerSettings",
    "gateway": "omniflow_services.gateway.config:GatewaySettings",
}


def service_settings(service: str) -> type[CommonSettings]:
    """The settings class of ``service`` (a key of ``SERVICE_SETTINGS``)."""
    path = SERVICE_SETTINGS.get(service)
    if path is None:
        raise OmniflowError(
            f"unknown service {service!r}; accepted: {', '.join(sorted(SERVICE_SETTINGS))}"
        )
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        raise OmniflowError(f"service {service!r} is not installed ({exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, CommonSettings)):
        raise OmniflowError(f"{path} is not a settings class")
    return cls


def _settings_table() -> str:
    services = (service_settings(s) for s in SERVICE_SETTINGS)
    # LocalSettings last: the service variables it also reads keep their services' rows.
    classes = (CommonSettings, SecuritySettings, TelemetrySettings, *services, LocalSettings)
    return settings_table(*classes)


BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def readme_with_settings(text: str) -> str:
    """``text`` with the settings table between its markers replaced by the current one."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise OmniflowError(f"no {BEGIN} ... {END} markers found")
    return f"{head}{BEGIN}\n{_settings_table()}\n{END}{tail}"


def write_settings_table(path: Path) -> None:
    path.write_text(readme_with_settings(path.read_text()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the local topology and wait until it is healthy")
    p_up.add_argument("--topology", type=Path, help="topology YAML (default: two llm workers)")
    p_up.add_argument("--timeout", type=float, default=120.0, help="seconds per service start")
    p_up.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, no tokens (development only; default: mutual TLS and auth)",
    )
    sub.add_parser("status", help="show the local topology")
    sub.add_parser("down", help="stop everything `omniflow up` started")
    p_key = sub.add_parser(
        "api-key", help="print the gateway API key of the running topology (OPENAI_API_KEY)"
    )
    p_key.add_argument("--admin", action="store_true", help="the admin key (shared tenant)")
    p_set = sub.add_parser("settings", help="print every setting as a Markdown table")
    p_set.add_argument(
        "--write", type=Path, help="replace the table between the settings markers of FILE"
    )
    workflow_cli.add_subcommands(sub)
    certs_cli.add_subcommand(sub)
    deploy_cli.add_subcommand(sub)
    p_models = sub.add_parser(
        "models", help="model tools: pull NAME, list, convert-gguf FILE OUT, make-tiny"
    )
    p_models.add_argument(
        "args", nargs=argparse.REMAINDER, help="e.g. pull smollm2-135m-instruct; -h for each"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("omniflow", "WARNING")
    try:
        if args.command in workflow_cli.COMMANDS:
            # omniflow.client.Client presents the run folder's client certificate only when
            # no coordinator address is given: an address is another topology's.
            return workflow_cli.dispatch(args)
        if args.command == "up":
            from omniflow.cli import local
            from omniflow.deploy.topology import load_topology

            topology = load_topology(args.topology)
            return asyncio.run(local.up(topology, args.timeout, insecure=args.insecure))
        if args.command == "status":
            from omniflow.cli import local

            return asyncio.run(local.status())
        if args.command == "down":
            from omniflow.cli import local

            return local.down()
        if args.command == "api-key":
            from omniflow.cli import local

            return local.api_key(args.admin)
        if args.command == "settings":
            if args.write:
                write_settings_table(args.write)
            else:
                print(_settings_table())
            return 0
        if args.command == "certs":
            return certs_cli.run(args)
        if args.command == "deploy":
            return deploy_cli.run(args)
        if args.command == "models":
            from omniflow.models.cli import main as models_main

            return models_main(args.args)
    except OmniflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
