"""The worker's core: its role and, once loaded, its engine (no gRPC here)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from omniflow.errors import FailedPrecondition, InvalidArgument, Unimplemented
from omniflow.models.resolve import resolve_model
from omniflow.operations import served
from omniflow.records import build
from omniflow_services.worker.config import WorkerSettings
from omniflow_services.worker.llm.role import LLMRole
from omniflow_services.worker.llm.types import EngineLoad

# The engines and the models are imported when loaded, not here: a worker of the echo
# engine imports no torch (tests/worker/test_engine_interfaces.py).
if TYPE_CHECKING:
    from omniflow_services.worker.echo.role import EchoRole
    from omniflow_services.worker.embed.role import EmbedRole
    from omniflow_services.worker.mm.loading import LoadedRoles

log = logging.getLogger(__name__)


_T = TypeVar("_T")


def _required(serves: bool, role: str, wanted: str, loaded: _T | None) -> _T:
    """What a call of the ``wanted`` role needs: this worker serves it and has it loaded."""
    if not serves:
        raise FailedPrecondition(f"this worker's role is {role!r}, not {wanted!r}")
    if loaded is None:
        raise FailedPrecondition(
            "no model is loaded on this worker: set OMNIFLOW_WORKER_MODEL or call LoadModel"
        )
    return loaded


class WorkerCore:
    """A worker's role and engine."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.role = settings.role
        if self.role == "echo" and settings.engine != "echo":
            raise InvalidArgument(
                "OMNIFLOW_WORKER_ROLE=echo is the echo engine's test role: set "
                "OMNIFLOW_WORKER_ENGINE=echo, or another role"
            )
        if settings.engine != "echo":
            from omniflow_services.worker.engine.threads import apply_thread_budget, thread_budget

            # Before any torch op of this process (the engine is loaded later).
            apply_thread_budget(thread_budget(settings.torch_threads, settings.node_torch_workers))
        self.model = ""
        self.llm: LLMRole | None = None
        self.mm: LoadedRoles | None = None  # encoder, diffusion or talker models
        self.embed: EmbedRole | None = None  # the embed role's sentence-embedding model
        self.echo: EchoRole | None = None  # the echo TEST engine (it is ``llm`` too)

    @property
    def kv_namespace(self) -> bytes:
        return self.llm.engine.layout.namespace if self.llm else b""

    @property
    def operations(self) -> tuple[str, ...]:
        # The table's operations of the role; transcribe only with a Whisper model.
        can = self.mm.encoder.operations if self.mm is not None and self.mm.encoder else ()
        ops = served(self.role, model_can=can) if self.model else ()
        if self.echo is not None:  # a stand-in for an llm or a talker, with its own ops
            return self.echo.operations(self.role, ops)
        if self.llm is not None:  # sampling features beyond the common ones
            ops += self.llm.features
        return ops

    async def load(self, spec: str, dtype: str | None = None) -> None:
        """Load ``spec`` (a folder or tiny:<arch>) and warm the engine up."""
        s = self.settings
        if s.engine == "echo":
            await self._load_echo()
            return
        from omniflow_services.worker.engine.config import EngineConfig

        dtype = dtype or s.dtype
        if dtype not in ("float32", "bfloat16"):
            raise InvalidArgument(f"dtype {dtype!r} is not accepted; accepted: float32, bfloat16")
        # The settings of the same name (device, kv_cache_bytes, kernels), and the two the
        # worker names after its flags.
        config = build(
            EngineConfig,
            s,
            dtype=dtype,
            max_num_batched_tokens=s.max_batch_tokens,
            max_num_seqs=s.max_seqs,
        )
        if self.role == "embed":
            if s.engine != "torch":
                raise Unimplemented("role 'embed' runs on the built-in torch engine only")
            from omniflow_services.worker.embed.role import EmbedRole

            folder = resolve_model(spec, Path(s.models_dir))
            if self.embed is not None:  # a reload: the old batcher thread ends
                self.embed.close()
            self.embed = await EmbedRole.load(folder, s.device, s.max_seqs)
            self.model = str(folder)
            log.info("loaded embed model %s (%d dimensions)", folder, self.embed.dim)
            return
        if self.role in ("encoder", "diffusion", "talker"):
            if s.engine != "torch":
                raise Unimplemented(f"role {self.role!r} runs on the built-in torch engine only")
            from omniflow_services.worker.mm.loading import load_roles

            mm = await load_roles(self.role, spec, Path(s.models_dir), config)
            self.mm, self.llm, self.model = mm, mm.llm, mm.model
            log.info("loaded %s models %s", self.role, mm.model)
            return
        folder = resolve_model(spec, Path(s.models_dir))
        if s.engine == "sglang":
            # Imported only when selected: SGLang is an optional, GPU-only extra. Without it
            # this raises FailedPrecondition naming "pip install 'omniflow[sglang]'".
            from omniflow_services.worker.sglang.backend import load_sglang_role

            llm: LLMRole = await load_sglang_role(folder, s, dtype)
        elif s.engine == "vllm":
            # Imported only when selected: vLLM runs from its own virtualenv (docs/vllm.md).
            from omniflow_services.worker.vllm.backend import load_vllm_role

            llm = await load_vllm_role(folder, s, dtype)
        else:
            from omniflow_services.worker.engine.role import EngineRole

            llm = await EngineRole.load(folder, config)
        await llm.warm_up()
        self.llm, self.model = llm, str(folder)
        log.info("loaded %s (KV namespace %s)", folder, self.kv_namespace.hex())

    async def _load_echo(self) -> None:
        from omniflow_services.worker.echo.role import EchoRole

        if self.echo is not None:
            raise FailedPrecondition("the echo engine serves no model: there is none to load")
        self.echo = await EchoRole.load(self.settings)
        self.llm, self.model = self.echo, "echo"
        log.info("echo engine started (role %s)", self.role)

    def require_llm(self) -> LLMRole:
        """The llm engine (an llm or diffusion role, or the echo engine in any role)."""
        llm_like = self.role in ("llm", "diffusion") or self.echo is not None
        return _required(llm_like, self.role, "llm", self.llm)

    def require_mm(self, role: str) -> LoadedRoles:
        """The loaded models of a multimodal role (FailedPrecondition when not this role)."""
        return _required(self.role == role, self.role, role, self.mm)

    def require_embed(self) -> EmbedRole:
        """The embed role's model (FailedPrecondition when not this role or not loaded)."""
        return _required(self.role == "embed", self.role, "embed", self.embed)

    def load_now(self) -> EngineLoad:
        return self.llm.engine.load() if self.llm is not None else EngineLoad()
