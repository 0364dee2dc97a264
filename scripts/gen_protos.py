"""Generate Python code, gRPC stubs and type stubs from protos/ into libs/omniflow/api/.

Run by `make protos`. The output is git-ignored: it always matches the pinned grpcio-tools.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "libs"
API = OUT / "omniflow" / "api"


def main() -> int:
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not files:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    shutil.rmtree(API, ignore_errors=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *files,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    # Regular packages (not namespace packages) so that tools and setuptools see them.
    for d in [API, *(p for p in API.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    print(f"generated {len(files)} protos into {API.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
