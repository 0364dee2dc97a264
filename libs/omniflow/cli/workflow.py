"""``omniflow workflow register|show|list`` and ``omniflow run``: workflows from the CLI.

Hooked into ``omniflow.cli.main`` with :func:`add_subcommands` and :func:`dispatch`.
The coordinator is found from ``--coordinator``, ``OMNIFLOW_COORDINATOR_ADDR``, or the
run folder of ``omniflow up``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.errors import InvalidArgument
from omniflow.values import VType, brief, parse_cli_value, to_python

COMMANDS = ("workflow", "run")


def add_subcommands(subparsers: Any) -> None:
    """Add ``workflow`` and ``run`` to the ``omniflow`` parser's subcommands."""
    p_wf = subparsers.add_parser("workflow", help="register, show and list workflows")
    wf_sub = p_wf.add_subparsers(dest="workflow_command", required=True)
    p_reg = wf_sub.add_parser("register", help="register every workflow a DSL file defines")
    p_reg.add_argument("file", type=Path, help="a Python file written with omniflow.dsl")
    p_show = wf_sub.add_parser("show", help="draw a workflow (from a file or the coordinator)")
    p_show.add_argument("target", help="a DSL file, or the name of a registered workflow")
    p_show.add_argument("--format", choices=("mermaid", "dot"), default="mermaid")
    p_show.add_argument("--version", type=int, default=0, help="registered version; 0: latest")
    wf_sub.add_parser("list", help="list registered workflows")
    for p in (p_reg, p_show, p_wf):
        p.add_argument("--coordinator", default="", help="coordinator host:port")

    p_run = subparsers.add_parser("run", help="run a registered workflow, showing node progress")
    p_run.add_argument("workflow", help="name of a registered workflow")
    p_run.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="K=V",
        help="an input value (typed by the workflow's input; @path reads a file as bytes, "
        "as does the path of an existing file given to a bytes or any input)",
    )
    p_run.add_argument("--version", type=int, default=0, help="0: the latest")
    p_run.add_argument("--deadline-ms", type=int, default=0, help="0: the workflow's default")
    p_run.add_argument("--quiet", "-q", action="store_true", help="print only the outputs")
    p_run.add_argument(
        "--out-dir",
        type=Path,
        default=Path("."),
        help="folder for outputs that are files (audio, images): WORKFLOW.OUTPUT.EXT",
    )
    p_run.add_argument("--coordinator", default="", help="coordinator host:port")


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed ``workflow`` or ``run`` command; returns the exit status."""
    if args.command == "run":
        return asyncio.run(_run(args))
    if args.workflow_command == "show" and Path(args.target).is_file():
        return _show_file(Path(args.target), args.format)
    return asyncio.run(_workflow(args))


def _show_file(path: Path, fmt: str) -> int:
    from omniflow.dsl import to_dot, to_mermaid
    from omniflow.dsl.loader import load_workflows

    for wf in load_workflows(path):
        graph = wf.compile()
        print(to_mermaid(graph) if fmt == "mermaid" else to_dot(graph))
    return 0


async def _workflow(args: argparse.Namespace) -> int:
    from omniflow.client import Client

    async with Client(args.coordinator) as client:
        if args.workflow_command == "register":
            from omniflow.dsl.loader import load_workflows

            for wf in load_workflows(args.file):
                version = await client.register(wf)
                print(f"registered {wf.name} v{version}")
            return 0
        if args.workflow_command == "show":
            from omniflow.dsl import to_dot, to_mermaid

            graph = await client.get_workflow(args.target, args.version)
            print(to_mermaid(graph) if args.format == "mermaid" else to_dot(graph))
            return 0
        rows = await client.list_workflows()
        for w in rows:
            print(f"{w.name}\tv{w.latest_version}\t{w.description}")
        if not rows:
            print("no workflows registered", file=sys.stderr)
        return 0


def parse_inputs(pairs: list[str], graph: cpb.WorkflowGraph) -> dict[str, Any]:
    """``k=v`` pairs typed by the graph's input ports; errors name the input."""
    ports = {p.name: VType(p.type) for p in graph.inputs}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise InvalidArgument(f"--input {pair!r} is not K=V")
        if key not in ports:
            raise InvalidArgument(
                f"workflow {graph.name!r} has no input {key!r}; inputs: {', '.join(ports)}"
            )
        if raw.startswith("@"):
            values[key] = _read(key, Path(raw[1:]))
            continue
        if ports[key] in (VType.BYTES, VType.ANY) and raw[:1] not in "[{" and Path(raw).is_file():
            values[key] = _read(key, Path(raw))  # e.g. audio=question.wav
            continue
        try:
            values[key] = parse_cli_value(raw, ports[key])
        except InvalidArgument as exc:
            raise InvalidArgument(f"input {key!r}: {exc}") from None
    return values


def _read(key: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"input {key!r}: cannot read {path}: {exc}") from None


_EXTENSIONS = ((b"RIFF", "wav"), (b"\x89PNG", "png"), (b"\xff\xd8\xff", "jpg"), (b"fLaC", "flac"))


def save_files(outputs: dict[str, Any], name: str, folder: Path) -> dict[str, Any]:
    """Bytes outputs written to ``folder`` as ``name.output.ext`` (by their magic); the
    outputs with those replaced by the paths written."""
    shown = dict(outputs)
    for key, value in outputs.items():
        if not isinstance(value, bytes) or not value:
            continue
        ext = next((e for magic, e in _EXTENSIONS if value.startswith(magic)), "bin")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.{key}.{ext}"
        path.write_bytes(value)
        shown[key] = str(path)
    return shown


class Progress:
    """Prints node progress lines as events arrive.

    A node's streamed text is shown as it is written, a line per sentence (or per
    ``LINE_CHARS``), not a line per token: an llm's hundred chunks are a few lines, and two
    nodes streaming at once (a streaming edge) do not interleave word by word."""

    LINE_CHARS = 72
    _END = re.compile(r"[.!?…]\s|\n")

    def __init__(self, out: TextIO, quiet: bool) -> None:
        self.out, self.quiet = out, quiet
        self.chunks: dict[str, int] = {}
        self.text: dict[tuple[str, str], str] = {}  # (node, output) -> text not yet shown

    def __call__(self, ev: cpb.RunEvent) -> None:
        if self.quiet:
            return
        kind = ev.WhichOneof("event")
        if kind == "node_started":
            e = ev.node_started
            where = f" on {e.worker_id}" if e.worker_id else ""
            again = f" (attempt {e.attempt})" if e.attempt > 1 else ""
            print(f"  > {e.node}{where}{again}", file=self.out, flush=True)
        elif kind == "node_output":
            e = ev.node_output
            self.chunks[e.node] = self.chunks.get(e.node, 0) + 1
            value = to_python(e.chunk)
            if e.output == "case":
                print(f"  ? {e.node} -> {value}", file=self.out, flush=True)
            elif isinstance(value, str):
                self._text(e.node, e.output, value)
        elif kind == "node_finished":
            e = ev.node_finished
            self._flush(e.node)
            if e.state == cpb.RUN_STATE_SUCCEEDED:
                print(f"  ok {e.node} ({e.duration_ms:.1f} ms)", file=self.out, flush=True)
            else:
                print(f"  FAILED {e.node}: {e.error}", file=self.out, flush=True)
        elif kind == "run_finished":
            self._flush(None)

    def _text(self, node: str, output: str, chunk: str) -> None:
        key = (node, output)
        pending = self.text.get(key, "") + chunk
        while True:
            end = self._END.search(pending)
            cut = end.end() if end else (len(pending) if len(pending) >= self.LINE_CHARS else 0)
            if not cut:
                break
            self._line(key, pending[:cut])
            pending = pending[cut:]
        self.text[key] = pending

    def _flush(self, node: str | None) -> None:
        for key in [k for k in self.text if node is None or k[0] == node]:
            self._line(key, self.text.pop(key))

    def _line(self, key: tuple[str, str], text: str) -> None:
        if text.strip():
            print(f"  ~ {key[0]}.{key[1]}: {text.strip()}", file=self.out, flush=True)


def _jsonable(value: Any) -> Any:
    """Outputs as JSON: plain values as they are, bytes and tensors briefly."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple) and not isinstance(value, bytes):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return brief(value)


async def _run(args: argparse.Namespace) -> int:
    from omniflow.client import Client

    async with Client(args.coordinator) as client:
        graph = await client.get_workflow(args.workflow, args.version)
        inputs = parse_inputs(args.input, graph)
        progress = Progress(sys.stderr, args.quiet)
        if not args.quiet:
            print(f"run {graph.name} v{graph.version}", file=sys.stderr, flush=True)
        result = await client.run(
            graph.name,
            inputs,
            version=graph.version,
            deadline_ms=args.deadline_ms,
            on_event=progress,
        )
    files = save_files(result.outputs, graph.name, args.out_dir) if result.ok else result.outputs
    shown = {k: _jsonable(v) for k, v in files.items()}
    if not args.quiet:
        print(f"{result.state}: run {result.run_id}", file=sys.stderr)
    if result.ok:
        print(json.dumps(shown, ensure_ascii=False, indent=2))
        return 0
    print(f"error: {result.error}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m omniflow.cli.workflow workflow|run ...`` (the same as ``omniflow ...``)."""
    from omniflow.errors import OmniflowError
    from omniflow.logsetup import setup_logging

    parser = argparse.ArgumentParser(prog="omniflow")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    setup_logging("omniflow", "WARNING")
    try:
        return dispatch(args)  # Client takes `omniflow up`'s certificate when no address given
    except OmniflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
