"""The built-in engine's own settings (the model's ``config.json`` is read by
``omniflow_services.worker.llm.model_folder.ModelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.errors import InvalidArgument

DTYPES = ("float32", "bfloat16", "float16")
MATMULS = ("auto", "onednn", "aten")
KERNELS = ("auto", "native", "torch")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine instance.

    ``num_pages`` sizes the device KV pool; when None, ``kv_cache_bytes`` decides it.
    ``max_num_batched_tokens`` is the per-step token budget that bounds chunked prefill;
    ``max_num_seqs`` bounds how many requests run at once. ``max_model_len`` caps the
    context (default and upper bound: the model's ``max_position_embeddings``).
    ``model_id`` names the model in the KV namespace (default: the folder's name); workers
    that should share KV pages must agree on it. ``matmul`` picks the linear layers' kernel:
    "onednn" (weights prepacked once; CPU bfloat16 only), "aten" (``F.linear``) or "auto"
    (onednn where it applies). ``decode_kv_bytes`` bounds the decode batch's contiguous K/V
    copy kept across steps (``decode_kv``; the torch path only); 0 gathers the pages at
    every step instead. ``kernels`` picks the elementwise and decode-attention kernels:
    "native" (the fused CPU kernels of ``kernels.cpp``, built on first use), "torch" (torch
    ops) or "auto" (native where they apply and build). ``adapt_threads`` lets a CPU engine
    with several intra-op threads drop to one while its cores are shared with another busy
    process, and come back after (``threads.ThreadTuner``).
    """

    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    model_id: str | None = None
    enable_prefix_cache: bool = True
    matmul: str = "auto"
    decode_kv_bytes: int = 1 << 30
    kernels: str = "auto"
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} not accepted; accepted: {list(DTYPES)}")
        if self.page_size <= 0:
            raise InvalidArgument(f"page_size must be > 0, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise InvalidArgument(f"num_pages must be > 0, got {self.num_pages}")
        if self.matmul not in MATMULS:
            raise InvalidArgument(f"matmul {self.matmul!r} not accepted; accepted: {list(MATMULS)}")
        if self.kernels not in KERNELS:
            raise InvalidArgument(
                f"kernels {self.kernels!r} not accepted; accepted: {list(KERNELS)}"
            )
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise InvalidArgument("max_num_batched_tokens and max_num_seqs must be > 0")
