"""How a worker appears in discovery: the metadata keys, and conversion to WorkerRecord.

Workers register under the discovery service name ``worker`` with their role, model,
KV namespace, node and operations in the metadata; the router and coordinator read
them back through :func:`worker_from_instance`. The roles and what each operation takes
are the table of ``omniflow.operations``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniflow.discovery import ServiceInstance
from omniflow.operations import ROLES

__all__ = ["ROLES", "WORKER_SERVICE", "WorkerRecord", "worker_from_instance", "worker_metadata"]

WORKER_SERVICE = "worker"


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

    @property
    def namespace_id(self) -> bytes:
        """``kv_namespace`` as its 16 bytes (discovery metadata is a text map, so it keeps the
        hex there); ``b""`` when the worker has none or registered something else."""
        try:
            raw = bytes.fromhex(self.kv_namespace)
        except ValueError:
            return b""
        return raw if len(raw) == 16 else b""


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
