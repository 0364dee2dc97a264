"""``omniflow models make-tiny | convert-gguf | pull | list``: the model tools' arguments."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.models.tiny import ARCHS, make_tiny
from omniflow.models.tiny_mm import MM_KINDS, make_tiny_kind
from omniflow.records import build


def add_make_tiny_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the make-tiny flags to ``parser`` (the lead's CLI reuses this for its subcommand)."""
    parser.add_argument(
        "--arch",
        choices=ARCHS + MM_KINDS,
        required=True,
        help="an LLM architecture, or a multimodal kind (size flags apply to LLMs only)",
    )
    parser.add_argument("--out", required=True, help="folder to write the model into")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--max-position", type=int, default=2048)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument(
        "--rope-scaling", default=None, help='JSON, e.g. \'{"rope_type": "linear", "factor": 2}\''
    )
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument(
        "--also",
        default="",
        help="comma-separated multimodal kinds to write next to --out, each as tiny-<kind> "
        f"(accepted: {', '.join(MM_KINDS)})",
    )


def run_make_tiny(args: argparse.Namespace) -> int:
    """Run make-tiny from parsed arguments; prints the folder written."""
    if args.arch in MM_KINDS:
        print(make_tiny_kind(args.arch, args.out, seed=args.seed))
        return 0
    # Every size flag is make_tiny's parameter of the same name.
    path = build(
        make_tiny,
        args,
        out_dir=args.out,
        rope_scaling=json.loads(args.rope_scaling) if args.rope_scaling else None,
    )
    print(path)
    for kind in [k.strip() for k in args.also.split(",") if k.strip()]:
        print(make_tiny_kind(kind, Path(args.out).parent / f"tiny-{kind}"))
    return 0


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run_convert(args: argparse.Namespace) -> int:
    from omniflow.models.gguf_convert import convert_gguf_atomic

    print(convert_gguf_atomic(args.file, args.out, dtype=args.dtype, progress=_progress))
    return 0


def _run_pull(args: argparse.Namespace) -> int:
    from omniflow.models.sources import DEFAULT_MODELS_DIR, pull

    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    for name in args.names:
        print(pull(name, models_dir, progress=_progress, force=args.force))
    return 0


def _run_list(_: argparse.Namespace) -> int:
    from omniflow.models.sources import SOURCES

    for source in SOURCES.values():
        print(f"{source.name}\t{source.kind}\t{source.description}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``omniflow models ...`` as a standalone entry point (argv excludes the program)."""
    parser = argparse.ArgumentParser(prog="omniflow models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_make_tiny_arguments(sub.add_parser("make-tiny", help="write a random tiny HF-format model"))
    p_conv = sub.add_parser(
        "convert-gguf", help="convert a Llama/Qwen2-family GGUF file into a Hugging Face folder"
    )
    p_conv.add_argument("file", help="the .gguf file")
    p_conv.add_argument("out", help="folder to write (replaced if it exists)")
    p_conv.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p_pull = sub.add_parser(
        "pull", help="convert a named model (see `omniflow models list`) into the model cache"
    )
    p_pull.add_argument("names", nargs="+", metavar="NAME")
    p_pull.add_argument("--models-dir", default=None, help="default: ~/.cache/omniflow/models")
    p_pull.add_argument("--force", action="store_true", help="rebuild even if already pulled")
    sub.add_parser("list", help="the named models `pull` knows")
    args = parser.parse_args(argv)
    run = {
        "make-tiny": run_make_tiny,
        "convert-gguf": _run_convert,
        "pull": _run_pull,
        "list": _run_list,
    }[args.command]
    try:
        return run(args)
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
