"""Loading the multimodal roles of a worker from their model settings (no gRPC here)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from omniflow.errors import InvalidArgument
from omniflow.models.resolve import resolve_model
from omniflow.models.sources import SOURCES
from omniflow.models.tiny_mm import IMAGE_HEAD_MODEL_TYPE
from omniflow_services.worker.engine import Engine, EngineConfig
from omniflow_services.worker.engine.role import EngineRole
from omniflow_services.worker.llm.connector import BlockEventSink, KVConnector
from omniflow_services.worker.mm.encoders import EncoderRole
from omniflow_services.worker.mm.image_role import DiffusionRole
from omniflow_services.worker.mm.piper_talker import PiperTalker, is_piper_folder
from omniflow_services.worker.mm.talker import TalkerRole

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedRoles:
    """What a multimodal worker holds once loaded; ``llm`` is set for diffusion (its
    backbone, which also serves Generate in the same process, with the same weights)."""

    model: str
    llm: EngineRole | None = None
    encoder: EncoderRole | None = None
    diffusion: DiffusionRole | None = None
    talker: TalkerRole | PiperTalker | None = None


def backbone_of(head_folder: Path) -> str:
    """The backbone an image head names in its config.json (a folder, a named source such
    as ``smollm2-135m-instruct``, or tiny:<arch>)."""
    cfg = json.loads((head_folder / "config.json").read_text())
    if cfg.get("model_type") != IMAGE_HEAD_MODEL_TYPE:
        raise InvalidArgument(
            f"{head_folder} holds model_type {cfg.get('model_type')!r}; a diffusion worker "
            f"needs {IMAGE_HEAD_MODEL_TYPE!r} (an image head naming its LLM backbone)"
        )
    backbone = str(cfg.get("backbone") or "")
    if not backbone:
        raise InvalidArgument(f"{head_folder}/config.json names no backbone")
    if (
        not backbone.startswith("tiny:")
        and backbone not in SOURCES
        and not Path(backbone).is_absolute()
    ):
        backbone = str((head_folder / backbone).resolve())
    return backbone


async def load_roles(
    role: str,
    spec: str,
    models_dir: Path,
    config: EngineConfig,
    *,
    connector: KVConnector | None = None,
    events: BlockEventSink | None = None,
) -> LoadedRoles:
    """Load the models of ``role`` (encoder: a comma-separated list of encoder folders).

    ``connector`` and ``events`` go to the diffusion role's engine: with the node agent's
    connector, prompt pages another worker produced are pulled instead of recomputed.
    """
    if role == "encoder":
        folders = [resolve_model(s.strip(), models_dir) for s in spec.split(",") if s.strip()]
        enc = await EncoderRole.load(folders, config.device)
        return LoadedRoles(",".join(str(f) for f in folders), encoder=enc)
    if role == "talker":
        folder = resolve_model(spec, models_dir)
        talker: TalkerRole | PiperTalker
        if is_piper_folder(folder):  # a Piper voice (ONNX): its own backend, same API
            import torch

            talker = await asyncio.to_thread(PiperTalker, folder, torch.get_num_threads())
        else:
            talker = await asyncio.to_thread(TalkerRole, folder, config.device, config.dtype)
        return LoadedRoles(str(folder), talker=talker)
    if role == "diffusion":
        head = resolve_model(spec, models_dir)
        backbone = resolve_model(backbone_of(head), models_dir)
        engine = await asyncio.to_thread(
            Engine, backbone, config, connector=connector, events=events
        )
        llm = EngineRole(engine, backbone)
        await llm.warm_up()
        diffusion = await DiffusionRole.load(head, llm.engine)
        return LoadedRoles(str(head), llm=llm, diffusion=diffusion)
    raise InvalidArgument(f"role {role!r} has no multimodal models")
