"""What the endpoint tests share: model names, the API key, and the topology's handle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omniflow.testing.launch import ServiceProc

LLM = "smollm2-135m-instruct"
WHISPER = "whisper-tiny.en"
MINILM = "all-minilm-l6-v2"
API_KEY = "endpoints-key-" + os.urandom(8).hex()
MAX_BODY = 4 * 1024 * 1024


@dataclass
class Endpoints:
    url: str  # http://127.0.0.1:PORT
    procs: dict[str, ServiceProc]
    llm_dir: Path
    whisper_dir: Path
    minilm_dir: Path
    api_key: str = API_KEY
    max_body: int = MAX_BODY

    @property
    def base_url(self) -> str:
        return self.url + "/v1"
