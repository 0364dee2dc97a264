"""``omniflow models make-tiny``: argument parsing for the tiny-model writer."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from omniflow.models.tiny import ARCHS, make_tiny
from omniflow.models.tiny_mm import MM_KINDS, make_tiny_kind


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
    path = make_tiny(
        args.arch,
        args.out,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        max_position=args.max_position,
        rope_theta=args.rope_theta,
        rope_scaling=json.loads(args.rope_scaling) if args.rope_scaling else None,
        tie_embeddings=args.tie_embeddings,
        dtype=args.dtype,
        seed=args.seed,
        shards=args.shards,
    )
    print(path)
    for kind in [k.strip() for k in args.also.split(",") if k.strip()]:
        print(make_tiny_kind(kind, Path(args.out).parent / f"tiny-{kind}"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``omniflow models make-tiny ...`` as a standalone entry point (argv excludes the program)."""
    parser = argparse.ArgumentParser(prog="omniflow models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_make_tiny_arguments(sub.add_parser("make-tiny", help="write a random tiny HF-format model"))
    args = parser.parse_args(argv)
    return run_make_tiny(args)


if __name__ == "__main__":
    raise SystemExit(main())
