"""The engine's fused CPU kernels (``kernels.cpp``), compiled on first use and cached.

The torch path of one decoder layer is about fifty small ops (the RMSNorm alone is seven
passes with its dtype casts, rotary four, SiLU-and-multiply three); on a CPU each is a pass
over memory plus dispatch overhead, and at one decoding request they cost as much as the
matmuls. The kernels do each of those in one pass, rounding where transformers rounds, and
decode attention reads each request's keys and values in place from the paged pool.

The extension is built with the machine's C++ compiler (``torch.utils.cpp_extension``,
``-march=native``) into ``~/.cache/omniflow/kernels/<key>`` (``OMNIFLOW_KERNEL_CACHE``), the
key covering the source, torch's version and the CPU's flags; torch's build lock lets several
workers start at once. Where no compiler exists, or with ``EngineConfig.kernels="torch"``
(a worker's ``OMNIFLOW_WORKER_KERNELS``), the engine runs its torch path: the same results,
slower. ``main`` builds the kernels ahead of time (``make setup`` and CI call it).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from pathlib import Path

import torch

from omniflow.config import load_settings
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.engine.config import KERNELS as CHOICES

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers, compiled only
# with it (without, every kernel ran on one thread whatever torch's thread count); the
# extension links libgomp.so.1 by its soname, which resolves to the copy torch has already
# loaded, so the kernels share torch's one OpenMP pool.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """The build folder for this source, torch and CPU."""
    root = Path(load_settings(WorkerSettings).kernel_cache).expanduser()
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    h.update(" ".join(FLAGS).encode())
    return root / h.hexdigest()[:16]


def load() -> bool:
    """Build (once per machine) and load the extension; False when it cannot be built."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        try:
            from torch.utils.cpp_extension import load as build

            where = cache_dir()
            where.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            fresh = not any(where.glob("*.so"))
            if fresh:
                log.info("building the engine's CPU kernels in %s (once per machine)", where)
            build(
                name="omniflow_engine_kernels",
                sources=[str(SOURCE)],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(where),
                is_python_module=False,
                verbose=False,
            )
            ok = hasattr(torch.ops.omniflow_engine, "decode_attention")
            if fresh:
                log.info("engine kernels built in %.1f s", time.monotonic() - started)
        except Exception as exc:  # any build failure means the torch path
            log.warning("engine CPU kernels unavailable (%s): running the torch path", exc)
            _state["error"] = str(exc)
        _state["ok"] = ok
        return ok


def wanted(choice: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` runs the kernels under setting ``choice``
    ("auto": where they apply and build; "native": required; "torch": never)."""
    if choice not in CHOICES:
        raise ValueError(f"kernels {choice!r} not accepted; accepted: {list(CHOICES)}")
    if choice == "torch":
        return False
    applies = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if choice == "native":
        if not applies:
            raise ValueError(f"the engine's native kernels run on CPU in bf16/fp32, not {dtype}")
        if not load():
            raise RuntimeError(f"the engine's native kernels did not build: {_state.get('error')}")
        return True
    return applies and load()


def ops():  # type: ignore[no-untyped-def]
    """The loaded kernels (``torch.ops.omniflow_engine``); call ``load`` first."""
    return torch.ops.omniflow_engine


def main() -> int:
    """Build the kernels now (prints where, or why not; exit status 1 when they did not)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not load():
        print(f"engine kernels did not build: {_state.get('error')}", file=sys.stderr)
        return 1
    print(f"engine kernels ready in {cache_dir()}")
    return 0
