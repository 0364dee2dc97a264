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
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_cluster import VLLM_ENV, VLLM_PYTHON

from omniflow.testing.launch import spawn, stop_all

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
        # A session of its own: its engine processes are stopped with its process group.
        self.proc = spawn(args, "vllm-server", tmp, env, group=True, cwd=tmp)
        self.popen, self.log = self.proc.popen, self.proc.log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> VLLMServer:
        self.proc.wait_ready(timeout_s, probe=self._healthy)
        return self

    def _healthy(self) -> bool:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                return True
        return False

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
        return self.proc.tail(chars)

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after a while, then what is left of its process
        group (the engine core), while the server is still unreaped."""
        stop_all([self.proc], timeout_s=20)
