"""Kubernetes objects for one topology: what ``omniflow deploy k8s`` prints.

The topology file is the one ``omniflow up`` reads (``omniflow.deploy.topology``); one entry
of ``workers`` becomes one Deployment of ``count`` replicas, ``routers``/``coordinators``/
``gateways`` the replicas of theirs (the gateway's Service balances over its replicas).
What a cluster adds:

- **Per node**: the kv-agent is a DaemonSet. Its host tier is POSIX shared memory, and pods
  cannot join another pod's IPC namespace, so the agent and every worker run with
  ``hostIPC`` (the node's /dev/shm), with the namespace as the shared-memory tag; a worker
  reaches its own node's agent through the ``kv-agent`` Service with
  ``internalTrafficPolicy: Local``. Workers and agents carry the node's name as their node id.
- **Discovery** is the Redis backend on the in-cluster Redis (a StatefulSet, AOF on, one
  volume); every pod advertises its pod IP, peers are found through discovery.
- **Trust**: mutual TLS and tokens on. Each pod's certificate is issued at start by an init
  container from the CA in the Secret ``omniflow-ca`` (only that container mounts it; the
  key is deleted before the service starts), for ``<kind>/<node>/<pod>`` with the pod's IP
  and Service names; tokens and gateway API keys are the Secret ``omniflow-tokens``. Both
  Secrets are rendered from a folder made by ``omniflow certs`` (``--pki DIR``), else left
  to ``kubectl create secret`` (the command is in the rendered header).
- **Probes**: readiness is the gRPC health check (SERVING) through the image's
  ``omniflow-healthcheck``, which presents the pod's certificate (kubelet's own gRPC probe
  cannot); liveness is the listening port; workers get a startup probe for model loading.
- **Sizing**: memory requests from the resident set measured per service (``MEASURED_RSS``).
- **Metrics**: Prometheus scrape annotations on every pod; an HPA scales each llm
  Deployment on ``omniflow_worker_requests_waiting`` (a Pods metric: needs a metrics
  adapter such as prometheus-adapter serving it).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omniflow.deploy.topology import Topology, WorkerSpec
from omniflow.errors import InvalidArgument

Obj = dict[str, Any]

PORTS = {"kv-index": 50051, "kv-agent": 50052, "router": 50053, "coordinator": 50054}
WORKER_PORT = 50060
GATEWAY_PORT = 8000
METRICS_PORT = 9100
REDIS_PORT = 6379

#: Resident set (MiB) of each service after start-up and a few requests, measured in the
#: compose stack (`docker stats --no-stream` in tests/deploy/test_compose_run.py, after its
#: chats, a workflow run and a worker restart; CPU torch, float32, SmolLM2-135M): the request
#: is this with a quarter more, the limit twice the request. The kv-agent's host tier lives
#: in shared memory charged to the node, so its budget is added to the agent's request.
MEASURED_RSS = {
    "kv-index": 54,
    "router": 44,
    "coordinator": 89,
    "gateway": 95,
    "kv-agent": 70,
    "redis": 7,
    "worker:llm": 774,
    "worker:encoder": 342,
    "worker:diffusion": 815,
    "worker:talker": 265,
    "worker:embed": 195,
}
#: CPU requests (millicores): the control plane idles; an engine uses what it is given.
CPU_REQUEST = {"worker": 1000, "redis": 100}


@dataclass(frozen=True, slots=True)
class K8sOptions:
    """How the objects are named and what they pull."""

    namespace: str = "omniflow"
    image_prefix: str = "omniflow/"
    tag: str = "dev"
    redis_image: str = "redis:7"
    #: A folder made by ``omniflow certs`` (ca.pem, ca.key, tokens.json, gateway-keys.json):
    #: rendered as the two Secrets. None: the Secrets are not rendered.
    pki_dir: Path | None = None
    models_storage: str = "20Gi"
    redis_storage: str = "8Gi"
    storage_class: str = ""
    hpa_max_replicas: int = 8
    hpa_waiting_per_pod: int = 2


def _labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": component,
        "app.kubernetes.io/part-of": "omniflow",
    }


def _meta(name: str, opts: K8sOptions, component: str | None = None) -> Obj:
    return {"name": name, "namespace": opts.namespace, "labels": _labels(component or name)}


def _memory(key: str, extra_mib: int = 0) -> dict[str, dict[str, str]]:
    rss = MEASURED_RSS[key]
    request = 64 * math.ceil((rss * 1.25 + extra_mib) / 64)
    cpu = CPU_REQUEST.get(key.split(":")[0], 100)
    return {
        "requests": {"memory": f"{request}Mi", "cpu": f"{cpu}m"},
        "limits": {"memory": f"{2 * request}Mi"},
    }


def _host_tier_mib(topology: Topology) -> int:
    """The agent's host tier budget (its shared memory), in MiB."""
    raw = topology.kv_agent_env.get("OMNIFLOW_KV_HOST_BYTES", str(256 << 20))
    try:
        return math.ceil(int(raw) / (1 << 20))
    except ValueError:
        raise InvalidArgument(f"kv_agent host_bytes {raw!r} is not a number of bytes") from None


def _field(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _pod_env(port: int) -> list[Obj]:
    # Order matters: $(VAR) expands only variables declared before it.
    return [
        _field("POD_NAME", "metadata.name"),
        _field("NODE_NAME", "spec.nodeName"),
        _field("POD_IP", "status.podIP"),
        {"name": "OMNIFLOW_INSTANCE_ID", "value": "$(POD_NAME)"},
        {"name": "OMNIFLOW_NODE_ID", "value": "$(NODE_NAME)"},
        {"name": "OMNIFLOW_ADVERTISE_HOST", "value": "$(POD_IP)"},
        {"name": "OMNIFLOW_PORT", "value": str(port)},
    ]


def _pki_init(kind: str, service: str, opts: K8sOptions, image: str) -> Obj:
    """The init container that issues this pod's certificate from the CA Secret."""
    ns = opts.namespace
    script = (
        'set -e; d=$(mktemp -d); cp /ca/ca.pem /ca/ca.key "$d"/; '
        f'omniflow certs --dir "$d" --identity "{kind}/$NODE_NAME/$POD_NAME" '
        f"--dns {service} --dns {service}.{ns}.svc --dns {service}.{ns}.svc.cluster.local "
        '--dns "$POD_IP" >/dev/null; '
        'rm "$d/ca.key"; mv "$d/ca.pem" /pki/ca.pem; '
        'mv "$d"/*.pem /pki/tls.pem; mv "$d"/*.key /pki/tls.key; rm -r "$d"'
    )
    return {
        "name": "pki",
        "image": image,
        "command": ["sh", "-c", script],
        "env": _pod_env(0)[:3],
        "volumeMounts": [
            {"name": "ca", "mountPath": "/ca", "readOnly": True},
            {"name": "pki", "mountPath": "/pki"},
        ],
        "resources": {"requests": {"memory": "64Mi", "cpu": "50m"}},
    }


def _probes(port: int, startup: bool) -> Obj:
    probe = {
        "readinessProbe": {
            "exec": {"command": ["omniflow-healthcheck"]},
            "periodSeconds": 5,
            "timeoutSeconds": 4,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "tcpSocket": {"port": port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
    }
    if startup:
        # Model loading (and a first pull) may take minutes: liveness waits for it.
        probe["startupProbe"] = {
            "tcpSocket": {"port": port},
            "periodSeconds": 5,
            "failureThreshold": 120,
        }
    return probe


def _pod(
    component: str,
    kind: str,
    target: str,
    port: int,
    env: list[Obj],
    opts: K8sOptions,
    *,
    memory_key: str | None = None,
    extra_mib: int = 0,
    host_ipc: bool = False,
    models: bool = False,
    extra_volumes: list[Obj] = (),  # type: ignore[assignment]
    extra_mounts: list[Obj] = (),  # type: ignore[assignment]
    startup: bool = False,
) -> Obj:
    image = f"{opts.image_prefix}{target}:{opts.tag}"
    service = "kv-agent" if kind == "kv-agent" else component
    mounts = [
        {"name": "pki", "mountPath": "/pki", "readOnly": True},
        {"name": "tokens", "mountPath": "/secrets", "readOnly": True},
        *extra_mounts,
    ]
    volumes: list[Obj] = [
        {"name": "pki", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "ca", "secret": {"secretName": "omniflow-ca", "defaultMode": 0o440}},
        {"name": "tokens", "secret": {"secretName": "omniflow-tokens", "defaultMode": 0o440}},
        *extra_volumes,
    ]
    if models:
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": "omniflow-models"}}
        )
    container = {
        "name": component,
        "image": image,
        "envFrom": [{"configMapRef": {"name": "omniflow-settings"}}],
        "env": _pod_env(port) + env,
        "ports": [
            {"name": "grpc" if target != "gateway" else "http", "containerPort": port},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "volumeMounts": mounts,
        "resources": _memory(memory_key or kind, extra_mib),
        **_probes(port, startup),
    }
    spec: Obj = {
        "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
        "initContainers": [_pki_init(kind, service, opts, image)],
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 30,
    }
    if host_ipc:
        spec["hostIPC"] = True
    return {
        "metadata": {
            "labels": _labels(component),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(METRICS_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": spec,
    }


def _workload(kind: str, name: str, pod: Obj, opts: K8sOptions, replicas: int | None) -> Obj:
    spec: Obj = {"selector": {"matchLabels": _labels(name)}, "template": pod}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": _meta(name, opts), "spec": spec}


def _service(name: str, port: int, opts: K8sOptions, *, local: bool = False) -> Obj:
    spec: Obj = {
        "selector": _labels(name),
        "ports": [
            {"name": "http" if name == "gateway" else "grpc", "port": port, "targetPort": port}
        ],
    }
    if local:
        spec["internalTrafficPolicy"] = "Local"  # a worker talks to its own node's agent
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, opts), "spec": spec}


def _pvc_spec(size: str, mode: str, opts: K8sOptions) -> Obj:
    spec: Obj = {"accessModes": [mode], "resources": {"requests": {"storage": size}}}
    if opts.storage_class:
        spec["storageClassName"] = opts.storage_class
    return spec


def _redis(opts: K8sOptions) -> list[Obj]:
    pod = {
        "metadata": {"labels": _labels("redis")},
        "spec": {
            "containers": [
                {
                    "name": "redis",
                    "image": opts.redis_image,
                    # Durable: run records and workflows survive a restart.
                    "command": [
                        "redis-server",
                        "--appendonly",
                        "yes",
                        "--appendfsync",
                        "everysec",
                        "--dir",
                        "/data",
                    ],
                    "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    "resources": _memory("redis"),
                    "readinessProbe": {
                        "exec": {"command": ["redis-cli", "ping"]},
                        "periodSeconds": 5,
                    },
                    "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10},
                }
            ],
        },
    }
    sts = _workload("StatefulSet", "redis", pod, opts, 1)
    sts["spec"]["serviceName"] = "redis"
    sts["spec"]["volumeClaimTemplates"] = [
        {"metadata": {"name": "data"}, "spec": _pvc_spec(opts.redis_storage, "ReadWriteOnce", opts)}
    ]
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta("redis", opts),
        "spec": {"selector": _labels("redis"), "ports": [{"name": "redis", "port": REDIS_PORT}]},
    }
    return [sts, svc]


def _settings(opts: K8sOptions) -> Obj:
    data = {
        "OMNIFLOW_HOST": "0.0.0.0",
        "OMNIFLOW_DISCOVERY": "redis",
        "OMNIFLOW_REDIS_URL": f"redis://redis.{opts.namespace}.svc:{REDIS_PORT}/0",
        "OMNIFLOW_REGISTRATION_TTL_S": "10",
        "OMNIFLOW_METRICS_PORT": str(METRICS_PORT),
        "OMNIFLOW_TLS": "on",
        "OMNIFLOW_AUTH": "on",
        "OMNIFLOW_TLS_CA": "/pki/ca.pem",
        "OMNIFLOW_TLS_CERT": "/pki/tls.pem",
        "OMNIFLOW_TLS_KEY": "/pki/tls.key",
        "OMNIFLOW_TOKENS_FILE": "/secrets/tokens.json",
        "OMNIFLOW_MODELS_DIR": "/models",
        # Two installs in two namespaces on one node never share an arena.
        "OMNIFLOW_KV_SHM_TAG": opts.namespace,
        "OMNIFLOW_LOG_LEVEL": "INFO",
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta("omniflow-settings", opts, "settings"),
        "data": data,
    }


def _secrets(opts: K8sOptions) -> list[Obj]:
    if opts.pki_dir is None:
        return []
    files = {
        "omniflow-ca": ("ca.pem", "ca.key"),
        "omniflow-tokens": ("tokens.json", "gateway-keys.json"),
    }
    out = []
    for name, names in files.items():
        data = {}
        for f in names:
            path = opts.pki_dir / f
            if not path.is_file():
                raise InvalidArgument(
                    f"--pki {opts.pki_dir}: no {f} (make the folder with `omniflow certs "
                    "--dir DIR --token TENANT:user --api-key TENANT`)"
                )
            data[f] = base64.b64encode(path.read_bytes()).decode()
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": _meta(name, opts, "pki"),
                "data": data,
            }
        )
    return out


def _model_sources(topology: Topology) -> list[str]:
    """The named sources the workers load (not folders, not tiny:<arch>), in order."""
    names: list[str] = []
    for spec in topology.workers:
        for part in spec.model.split(","):
            part = part.strip()
            if part and "/" not in part and not part.startswith("tiny:") and part not in names:
                names.append(part)
    return names


def _models_job(topology: Topology, opts: K8sOptions) -> list[Obj]:
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta("omniflow-models", opts, "models"),
        "spec": _pvc_spec(opts.models_storage, "ReadWriteMany", opts),
    }
    names = _model_sources(topology)
    if not names:
        return [pvc]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta("omniflow-models", opts, "models"),
        "spec": {
            "backoffLimit": 3,
            "template": {
                "metadata": {"labels": _labels("models")},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "securityContext": {"runAsUser": 10001, "fsGroup": 10001},
                    "containers": [
                        {
                            "name": "pull",
                            "image": f"{opts.image_prefix}worker:{opts.tag}",
                            "command": [
                                "omniflow",
                                "models",
                                "pull",
                                "--models-dir",
                                "/models",
                                *names,
                            ],
                            "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                            "resources": _memory("worker:llm"),
                        }
                    ],
                    "volumes": [
                        {
                            "name": "models",
                            "persistentVolumeClaim": {"claimName": "omniflow-models"},
                        }
                    ],
                },
            },
        },
    }
    return [pvc, job]


def _worker_env(spec: WorkerSpec) -> list[Obj]:
    env = {
        "OMNIFLOW_WORKER_ROLE": spec.role,
        "OMNIFLOW_WORKER_MODEL": spec.model,
        "OMNIFLOW_KV_AGENT_ADDR": f"kv-agent:{PORTS['kv-agent']}",
        **spec.env,
    }
    return [{"name": k, "value": v} for k, v in env.items() if v != ""]


def _hpa(name: str, replicas: int, opts: K8sOptions) -> Obj:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(name, opts),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": max(1, replicas),
            "maxReplicas": max(opts.hpa_max_replicas, replicas),
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "omniflow_worker_requests_waiting"},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(opts.hpa_waiting_per_pod),
                        },
                    },
                }
            ],
        },
    }


def render(topology: Topology, opts: K8sOptions | None = None) -> list[Obj]:
    """Every object of ``topology`` in dependency order (namespace, settings, storage,
    Redis, control plane, node agents, workers, gateway)."""
    opts = opts or K8sOptions()
    out: list[Obj] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": opts.namespace, "labels": _labels("namespace")},
        },
        _settings(opts),
        *_secrets(opts),
        *_models_job(topology, opts),
        *_redis(opts),
    ]
    plane = (("kv-index", 1), ("router", topology.routers), ("coordinator", topology.coordinators))
    for name, replicas in plane:
        pod = _pod(name, name, name, PORTS[name], [], opts, models=name == "coordinator")
        out += [
            _workload("Deployment", name, pod, opts, replicas),
            _service(name, PORTS[name], opts),
        ]
    agent_env = [{"name": k, "value": v} for k, v in topology.kv_agent_env.items()]
    ssd = {
        "name": "ssd",
        "hostPath": {"path": f"/var/lib/omniflow/{opts.namespace}/kv", "type": "DirectoryOrCreate"},
    }
    agent_env.append({"name": "OMNIFLOW_KV_SSD_PATH", "value": "/var/lib/omniflow/kv/pages.bin"})
    agent = _pod(
        "kv-agent",
        "kv-agent",
        "kv-agent",
        PORTS["kv-agent"],
        agent_env,
        opts,
        host_ipc=True,
        extra_mib=_host_tier_mib(topology),
        extra_volumes=[ssd],
        extra_mounts=[{"name": "ssd", "mountPath": "/var/lib/omniflow/kv"}],
    )
    out += [
        _workload("DaemonSet", "kv-agent", agent, opts, None),
        _service("kv-agent", PORTS["kv-agent"], opts, local=True),
    ]
    for i, spec in enumerate(topology.workers):
        if spec.program != "worker":
            raise InvalidArgument(
                f"workers[{i}]: program {spec.program!r} is a test program; "
                "Kubernetes runs model workers only"
            )
        if spec.count == 0:
            continue
        name = f"{spec.role}-{i}"
        key = f"worker:{spec.role}" if f"worker:{spec.role}" in MEASURED_RSS else "worker:llm"
        pod = _pod(
            name,
            "worker",
            "worker",
            WORKER_PORT,
            _worker_env(spec),
            opts,
            memory_key=key,
            host_ipc=True,
            models=True,
            startup=True,
        )
        out.append(_workload("Deployment", name, pod, opts, spec.count))
        if spec.role == "llm":
            out.append(_hpa(name, spec.count, opts))
    gateway_env = [
        {"name": "OMNIFLOW_GATEWAY_PORT", "value": str(GATEWAY_PORT)},
        {"name": "OMNIFLOW_GATEWAY_API_KEYS_FILE", "value": "/secrets/gateway-keys.json"},
    ]
    pod = _pod("gateway", "gateway", "gateway", GATEWAY_PORT, gateway_env, opts, models=True)
    out += [
        _workload("Deployment", "gateway", pod, opts, topology.gateways),
        _service("gateway", GATEWAY_PORT, opts),
    ]
    return out


def header(topology: Topology, opts: K8sOptions) -> str:
    """The comment that heads the rendered stream: what it needs before ``kubectl apply``."""
    lines = [
        "# Omni-Flow on Kubernetes, rendered by `omniflow deploy k8s` (docs/deploy.md).",
        f"# Namespace {opts.namespace}; images {opts.image_prefix}<target>:{opts.tag} "
        "(compose/Dockerfile targets).",
        f"# llm workers scale on omniflow_worker_requests_waiting (> {opts.hpa_waiting_per_pod} "
        "per pod): needs a metrics adapter serving that Pods metric.",
    ]
    if opts.pki_dir is None:
        lines += [
            "# The Secrets are not in this file. Make them once:",
            "#   omniflow certs --dir pki --token TENANT:user --token :admin --api-key TENANT",
            f"#   kubectl -n {opts.namespace} create secret generic omniflow-ca "
            "--from-file=pki/ca.pem --from-file=pki/ca.key",
            f"#   kubectl -n {opts.namespace} create secret generic omniflow-tokens "
            "--from-file=pki/tokens.json --from-file=pki/gateway-keys.json",
        ]
    return "\n".join(lines) + "\n"


def to_yaml(objects: list[Obj]) -> str:
    """The objects as one YAML stream, keys in the order they were built."""
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False, width=100)
