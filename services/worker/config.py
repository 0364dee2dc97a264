"""Worker settings."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.config import CommonSettings, peer_address, setting
from omniflow.workers import ROLES


@dataclass(frozen=True, slots=True)
class WorkerSettings(CommonSettings):
    """Settings of a worker (plus the common ones)."""

    role: str = setting(
        "OMNIFLOW_WORKER_ROLE",
        "llm",
        "role this worker serves (echo: the echo engine's own test role)",
        choices=(*ROLES, "echo"),
    )
    model: str = setting(
        "OMNIFLOW_WORKER_MODEL",
        "",
        "model folder (Hugging Face format), or tiny:qwen2 / tiny:llama for a small random "
        "model generated on first use; empty: no model loaded",
    )
    models_dir: str = setting(
        "OMNIFLOW_MODELS_DIR", "~/.cache/omniflow/models", "where tiny:<arch> models are written"
    )
    kernel_cache: str = setting(
        "OMNIFLOW_KERNEL_CACHE",
        "~/.cache/omniflow/kernels",
        "where the engine's fused CPU kernels are built, once per source, torch and CPU",
    )
    kv_cache_bytes: int = setting(
        "OMNIFLOW_WORKER_KV_BYTES", 256 * 1024 * 1024, "device KV pool size in bytes", minimum=1
    )
    max_batch_tokens: int = setting(
        "OMNIFLOW_WORKER_MAX_BATCH_TOKENS", 512, "token budget of one engine step", minimum=1
    )
    max_seqs: int = setting(
        "OMNIFLOW_WORKER_MAX_SEQS", 64, "requests batched in one engine step", minimum=1
    )
    max_prompt_bytes: int = setting(
        "OMNIFLOW_WORKER_MAX_PROMPT_BYTES",
        1 << 20,
        "largest prompt, in bytes, refused before it is tokenized: text as UTF-8, chat "
        "messages serialized, token ids as 4 bytes each (the context length bounds its "
        "tokens after)",
        minimum=1,
    )
    engine: str = setting(
        "OMNIFLOW_WORKER_ENGINE",
        "torch",
        "engine backend (vllm: run the worker from vLLM's venv, see docs/vllm.md; echo: the "
        "TEST engine, no model, see docs/engine.md)",
        choices=("torch", "sglang", "vllm", "echo"),
    )
    device: str = setting("OMNIFLOW_WORKER_DEVICE", "cpu", "torch device (cpu, cuda, cuda:1)")
    dtype: str = setting(
        "OMNIFLOW_WORKER_DTYPE", "float32", "weights and KV dtype", choices=("float32", "bfloat16")
    )
    kernels: str = setting(
        "OMNIFLOW_WORKER_KERNELS",
        "auto",
        "the built-in engine's elementwise and decode-attention kernels: native (fused C++, "
        "compiled on first use, cached in ~/.cache/omniflow/kernels), torch, or auto (native "
        "where a compiler builds them); see docs/engine.md",
        choices=("auto", "native", "torch"),
    )
    kv_agent_addr: str = peer_address("OMNIFLOW_KV_AGENT_ADDR", "this node's kv-agent")
    torch_threads: int = setting(
        "OMNIFLOW_WORKER_TORCH_THREADS",
        0,
        "torch/OpenMP threads of this worker; 0: the node's cores divided among its torch "
        "workers (OMNIFLOW_NODE_TORCH_WORKERS), at least 1",
        minimum=0,
    )
    node_torch_workers: int = setting(
        "OMNIFLOW_NODE_TORCH_WORKERS",
        1,
        "torch worker processes on this node (set by `omniflow up` and compose); sizes the "
        "default thread budget",
        minimum=1,
    )
    kv_connect: bool = setting(
        "OMNIFLOW_WORKER_KV_CONNECT",
        True,
        "share KV through the node's kv-agent and announce device pages in the index",
    )
    prefill_store_timeout_s: float = setting(
        "OMNIFLOW_WORKER_PREFILL_STORE_TIMEOUT_S",
        5.0,
        "how long a prefill_only reply waits for the agent to acknowledge its full pages; "
        "past it the reply goes out anyway (counted in "
        "omniflow_worker_prefill_store_incomplete_total)",
        minimum=0.0,
    )
    # The echo TEST engine (OMNIFLOW_WORKER_ENGINE=echo, docs/engine.md): its fake step costs.
    echo_token_delay_ms: float = setting(
        "OMNIFLOW_ECHO_TOKEN_DELAY_MS",
        0.0,
        "echo engine: fixed time of one step (one generated word per request in decode)",
        minimum=0,
    )
    echo_prefill_us: float = setting(
        "OMNIFLOW_ECHO_PREFILL_US", 0.0, "echo engine: time per uncached prompt byte", minimum=0
    )
    echo_decode_us: float = setting(
        "OMNIFLOW_ECHO_DECODE_US", 0.0, "echo engine: step time per request in decode", minimum=0
    )
    echo_step_tokens: int = setting(
        "OMNIFLOW_ECHO_STEP_TOKENS", 2048, "echo engine: prefill bytes of one step", minimum=1
    )
    echo_max_running: int = setting(
        "OMNIFLOW_ECHO_MAX_RUNNING", 256, "echo engine: requests batched; more wait", minimum=1
    )
    echo_cache_blocks: int = setting(
        "OMNIFLOW_ECHO_CACHE_BLOCKS", 4096, "echo engine: prefix cache blocks (LRU)", minimum=1
    )
    echo_publish_kv: bool = setting(
        "OMNIFLOW_ECHO_PUBLISH_KV",
        False,
        "echo engine: publish its cached blocks to the KV index's Redis (kv_aware routing)",
    )
    echo_weight: float = setting(
        "OMNIFLOW_ECHO_WEIGHT", 1.0, "echo engine: the weight in discovery metadata (weighted)"
    )
