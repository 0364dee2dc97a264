"""Worker roles and their operations (the one table), and how a worker appears in
discovery: the metadata keys, and conversion to WorkerInfo.

Workers register under the discovery service name ``worker`` with their role, model,
KV namespace, node and operations in the metadata; the router and coordinator read
them back through :func:`worker_from_instance`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniflow.discovery import ServiceInstance

WORKER_SERVICE = "worker"

#: The roles a worker can serve (``OMNIFLOW_WORKER_ROLE``, a topology's ``role:``).
ROLES = ("llm", "encoder", "diffusion", "talker", "embed")

#: Operations each role serves once its model is loaded (advertised in discovery).
ROLE_OPERATIONS: dict[str, tuple[str, ...]] = {
    "llm": ("generate",),
    "encoder": ("encode",),
    "diffusion": ("generate_image", "generate"),  # its backbone serves Generate too
    "talker": ("synthesize",),
    "embed": ("embed",),  # through Invoke: token ids in, one pooled vector per input out
}

#: Operations a role adds through ``Invoke`` when its model can (an encoder with Whisper).
MODEL_OPERATIONS: dict[str, tuple[str, ...]] = {"encoder": ("transcribe",)}


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker as the control plane sees it (plain data, no protobuf)."""

    worker_id: str
    role: str
    address: str
    node: str
    model: str = ""
    kv_namespace: str = ""
    operations: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


def worker_metadata(
    role: str, node: str, model: str, kv_namespace: str, operations: tuple[str, ...]
) -> dict[str, str]:
    """The registration metadata of a worker."""
    return {
        "role": role,
        "node": node,
        "model": model,
        "kv_namespace": kv_namespace,
        "operations": ",".join(operations),
    }


def worker_from_instance(inst: ServiceInstance) -> WorkerRecord:
    meta = inst.metadata
    ops = tuple(o for o in meta.get("operations", "").split(",") if o)
    return WorkerRecord(
        worker_id=inst.instance_id,
        role=meta.get("role", ""),
        address=inst.address,
        node=meta.get("node", ""),
        model=meta.get("model", ""),
        kv_namespace=meta.get("kv_namespace", ""),
        operations=ops,
        metadata=dict(meta),
    )
