"""``omniflow deploy k8s``: Kubernetes manifests from the topology ``omniflow up`` reads.

    omniflow deploy k8s [--topology FILE] [--namespace NS] [--image-prefix P] [--tag T]
                        [--pki DIR] [--out FILE]

prints (or writes to FILE) one YAML stream of every object (``omniflow.deploy.k8s``); with
``--pki DIR`` (a folder made by ``omniflow certs``) the CA and token Secrets are in it too.
docs/deploy.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

COMMANDS = ("deploy",)


def add_subcommand(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("deploy", help="render deployment manifests (k8s) from a topology")
    p.add_argument("target", choices=("k8s",), help="what to render: k8s (Kubernetes objects)")
    p.add_argument("--topology", type=Path, help="topology YAML (default: `omniflow up`'s)")
    p.add_argument("--namespace", default="omniflow", help="Kubernetes namespace")
    p.add_argument("--image-prefix", default="omniflow/", help="image names: PREFIX<target>:TAG")
    p.add_argument("--tag", default="dev", help="image tag")
    p.add_argument("--redis-image", default="redis:7", help="the Redis image")
    p.add_argument("--storage-class", default="", help="storage class of the volume claims")
    p.add_argument("--pki", type=Path, help="an `omniflow certs` folder: render the Secrets")
    p.add_argument("--out", type=Path, help="write the YAML here instead of stdout")


def run(args: argparse.Namespace) -> int:
    from omniflow.deploy.k8s import K8sOptions, header, render, to_yaml
    from omniflow.deploy.topology import load_topology
    from omniflow.records import build

    topology = load_topology(args.topology)
    opts = build(K8sOptions, args, pki_dir=args.pki)  # each flag is the option of its name
    text = header(topology, opts) + to_yaml(render(topology, opts))
    if args.out:
        args.out.write_text(text)
        if opts.pki_dir is not None:
            args.out.chmod(0o600)  # it holds the CA key
    else:
        print(text, end="")
    return 0
