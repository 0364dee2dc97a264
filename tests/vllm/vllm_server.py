"""vLLM's own OpenAI server as a reference (``python -m vllm.entrypoints.openai.api_server``
from vLLM's virtualenv), on a port of its own, for tests that compare answers with it.

One server per module (``vllm_server`` in conftest.py): it takes about a minute to start on
a small CPU. Started in a session of its own, and ended, with its engine processes, by the
PID (and so the process group) it was started with.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_cluster import VLLM_ENV, VLLM_PYTHON

SERVED_NAME = "smollm2-135m-instruct"
START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """A running vLLM OpenAI server: ``base_url`` (…/v1), ``post`` a JSON body, ``stop``."""

    def __init__(self, model: Path, tmp: Path, dtype: str = "float32") -> None:
        self.model, self.port = model, free_port()
        self.log = tmp / "vllm-server.log"
        args = [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
            "--max-model-len", "4096", "--seed", "0",
            # No torch.compile warm-up (minutes on a small shared CPU), as the worker starts it.
            "--enforce-eager",
            # The model folder's generation_config.json sets no sampling defaults; say so
            # anyway, so that a request's unset fields are vLLM's own defaults, as ours are.
            "--generation-config", "vllm",
        ]  # fmt: skip
        env = {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=tmp, start_new_session=True,
            )  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> VLLMServer:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"vLLM's server exited ({self.popen.returncode}):\n{self.tail()}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            time.sleep(1.0)
        raise TimeoutError(f"vLLM's server not up after {timeout_s:.0f}s:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """POST ``body`` to ``/v1/<path>``: the JSON reply (an error body as it came)."""
        req = urllib.request.Request(
            f"{self.base_url}/{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                return dict(json.loads(reply.read()))
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, **json.loads(exc.read() or b"{}")}

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after a while, then what is left of its process
        group (the engine core), while the server is still unreaped."""
        pid = self.popen.pid
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + 20
            while not _exited(pid) and time.monotonic() < end:
                time.sleep(0.1)
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)
                while not _exited(pid):
                    time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        self.popen.wait()


def _exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
