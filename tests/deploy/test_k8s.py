"""`omniflow deploy k8s`: the rendered objects validate against Kubernetes' own API schemas
(kubernetes-validate, strict: no unknown field) for 1.30 and the newest release it bundles,
and hold to the project: every variable a container gets is a setting of that service, the
kv-agent is a DaemonSet whose node's workers share its IPC, probes run the gRPC health
check, and the topology file of `omniflow up` decides the replicas and workers."""

from __future__ import annotations

import base64
import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from omniflow.cli.main import service_settings
from omniflow.config import CommonSettings, SecuritySettings
from omniflow.deploy.k8s import K8sOptions, render, to_yaml
from omniflow.deploy.topology import load_topology, parse_topology
from omniflow.errors import InvalidArgument
from omniflow.security.bundle import make_bundle

kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (dev extra)")

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("1.30.0", kv.utils.latest_version())
# Variables Kubernetes sets from the downward API for $(VAR) expansion, not settings.
DOWNWARD = {"POD_NAME", "NODE_NAME", "POD_IP"}
TARGET_SERVICE = {
    "kv-index": "kv-index",
    "router": "router",
    "coordinator": "coordinator",
    "kv-agent": "kv-agent",
    "gateway": "gateway",
    "worker": "worker",
}


def _by(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _validate(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        kv.validate(obj, version, strict=True)


def _env_names(settings_cls: type) -> set[str]:
    out = set()
    for cls in (settings_cls, CommonSettings, SecuritySettings):
        out |= {f.metadata["env"] for f in dataclasses.fields(cls) if f.metadata.get("env")}
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pki")
    bundle = make_bundle(folder, [], ["demo:user", ":admin"])
    assert bundle.tokens_file is not None
    from omniflow.cli.certs import _api_keys

    _api_keys(folder, ["demo"])
    return folder


@pytest.fixture(scope="module")
def objects(pki: Path) -> list[dict[str, Any]]:
    return render(load_topology(None), K8sOptions(pki_dir=pki))


def test_every_object_validates(objects: list[dict[str, Any]]) -> None:
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace",
        "ConfigMap",
        "Secret",
        "StatefulSet",
        "Deployment",
        "DaemonSet",
        "Service",
        "HorizontalPodAutoscaler",
        "Job",
        "PersistentVolumeClaim",
    } <= kinds
    for obj in objects:
        _validate(obj)


def test_validator_refuses_what_kubernetes_refuses(objects: list[dict[str, Any]]) -> None:
    """The check is live: a field Kubernetes does not know, or a wrong type, fails it."""
    dep = copy.deepcopy(_by(objects, "Deployment")["router"])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, VERSIONS[0], strict=True)
    dep = copy.deepcopy(_by(objects, "Deployment")["router"])
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, VERSIONS[0], strict=True)


def test_containers_get_only_settings_of_their_service(objects: list[dict[str, Any]]) -> None:
    config = _by(objects, "ConfigMap")["omniflow-settings"]["data"]
    everyone = set().union(*(_env_names(service_settings(s)) for s in TARGET_SERVICE.values()))
    assert set(config) <= everyone, set(config) - everyone
    for kind in ("Deployment", "DaemonSet"):
        for name, obj in _by(objects, kind).items():
            for c in obj["spec"]["template"]["spec"]["containers"]:
                target = c["image"].rsplit("/", 1)[1].split(":")[0]
                known = _env_names(service_settings(TARGET_SERVICE[target])) | DOWNWARD
                names = {e["name"] for e in c["env"]}
                assert names <= known, f"{name}: {names - known} are not {target} settings"
                env = {e["name"]: e.get("value") for e in c["env"]}
                # No loopback assumption: each pod advertises its own address and node.
                assert env["OMNIFLOW_ADVERTISE_HOST"] == "$(POD_IP)"
                assert env["OMNIFLOW_NODE_ID"] == "$(NODE_NAME)"
                for e in c["env"]:  # $(VAR) expands only variables declared before it
                    for ref in DOWNWARD:
                        if f"$({ref})" in (e.get("value") or ""):
                            assert [x["name"] for x in c["env"]].index(ref) < c["env"].index(e)


def test_node_agent_and_workers_share_ipc(objects: list[dict[str, Any]]) -> None:
    agent = _by(objects, "DaemonSet")["kv-agent"]
    assert agent["spec"]["template"]["spec"]["hostIPC"] is True
    svc = _by(objects, "Service")["kv-agent"]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    workers = {
        n: d
        for n, d in _by(objects, "Deployment").items()
        if d["spec"]["template"]["spec"]["containers"][0]["image"].endswith("worker:dev")
    }
    assert sorted(workers) == ["diffusion-2", "embed-4", "encoder-1", "llm-0", "talker-3"]
    for name, dep in workers.items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True, name
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["OMNIFLOW_KV_AGENT_ADDR"] == "kv-agent:50052"
    assert workers["llm-0"]["spec"]["replicas"] == 2


def test_probes_health_resources_metrics(objects: list[dict[str, Any]]) -> None:
    for kind in ("Deployment", "DaemonSet"):
        for name, obj in _by(objects, kind).items():
            tmpl = obj["spec"]["template"]
            c = tmpl["spec"]["containers"][0]
            assert c["readinessProbe"]["exec"]["command"] == ["omniflow-healthcheck"], name
            assert "tcpSocket" in c["livenessProbe"], name
            assert c["resources"]["requests"]["memory"].endswith("Mi"), name
            assert tmpl["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
            init = tmpl["spec"]["initContainers"][0]
            assert {"name": "ca", "mountPath": "/ca", "readOnly": True} in init["volumeMounts"]
            assert all(m["name"] != "ca" for m in c["volumeMounts"]), "the CA key stays out"
    hpa = _by(objects, "HorizontalPodAutoscaler")["llm-0"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    source = (ROOT / "services" / "worker" / "metrics.py").read_text()
    assert f'"{metric}"' in source, f"the HPA's metric {metric} is not one the workers export"
    redis = _by(objects, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"


def test_secrets_from_the_certs_folder(objects: list[dict[str, Any]], pki: Path) -> None:
    secrets = _by(objects, "Secret")
    assert (
        base64.b64decode(secrets["omniflow-ca"]["data"]["ca.pem"]) == (pki / "ca.pem").read_bytes()
    )
    assert set(secrets["omniflow-tokens"]["data"]) == {"tokens.json", "gateway-keys.json"}
    assert not _by(render(load_topology(None)), "Secret"), "no --pki: no Secret rendered"
    with pytest.raises(InvalidArgument, match=r"no ca\.pem"):
        render(load_topology(None), K8sOptions(pki_dir=pki / "missing"))


def test_pki_init_script_issues_a_pod_certificate(tmp_path: Path, pki: Path) -> None:
    """The init container's script, run here as a pod would run it: the pod gets its own
    certificate for kind/node/pod, the CA's key is not left beside it."""
    obj = _by(render(load_topology(None)), "DaemonSet")["kv-agent"]
    script = obj["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    ca, out = tmp_path / "ca", tmp_path / "pki"
    ca.mkdir()
    out.mkdir()
    for f in ("ca.pem", "ca.key"):
        (ca / f).write_bytes((pki / f).read_bytes())
    script = script.replace("/ca/", f"{ca}/").replace("/pki/", f"{out}/")
    env = {
        **os.environ,
        "NODE_NAME": "node-7",
        "POD_NAME": "kv-agent-x2",
        "POD_IP": "198.18.0.7",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=60)
    assert sorted(p.name for p in out.iterdir()) == ["ca.pem", "tls.key", "tls.pem"]
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((out / "tls.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "omniflow://kv-agent/node-7/kv-agent-x2" in sans.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert "kv-agent.omniflow.svc" in sans.get_values_for_type(x509.DNSName)
    assert next(str(ip) for ip in sans.get_values_for_type(x509.IPAddress)) == "198.18.0.7"


def test_topology_file_drives_the_objects(tmp_path: Path) -> None:
    topo = parse_topology(
        "routers: 2\ncoordinators: 3\ngateways: 2\nkv_agent: {host_bytes: 1048576}\n"
        "workers:\n"
        "  - {role: llm, count: 3, model: tiny:qwen2, env: {OMNIFLOW_WORKER_DTYPE: bfloat16}}\n"
    )
    objs = render(topo, K8sOptions(namespace="ns2", tag="v1"))
    deps = _by(objs, "Deployment")
    assert deps["router"]["spec"]["replicas"] == 2
    assert deps["coordinator"]["spec"]["replicas"] == 3
    assert deps["gateway"]["spec"]["replicas"] == 2  # behind the gateway Service
    llm = deps["llm-0"]["spec"]["template"]["spec"]["containers"][0]
    assert llm["image"] == "omniflow/worker:v1"
    env = {e["name"]: e.get("value") for e in llm["env"]}
    assert (
        env["OMNIFLOW_WORKER_DTYPE"] == "bfloat16" and env["OMNIFLOW_WORKER_MODEL"] == "tiny:qwen2"
    )
    agent = _by(objs, "DaemonSet")["kv-agent"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "OMNIFLOW_KV_HOST_BYTES", "value": "1048576"} in agent["env"]
    # The host tier (shared memory charged to the node) is in the agent's memory request.
    assert agent["resources"]["requests"]["memory"] == "128Mi"  # 70 MiB * 1.25 + 1 MiB
    default = _by(render(load_topology(None)), "DaemonSet")["kv-agent"]
    assert default["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "memory": "384Mi",  # 70 MiB * 1.25 + the default 256 MiB, in 64 MiB steps
        "cpu": "100m",
    }
    assert all(o["metadata"].get("namespace", "ns2") == "ns2" for o in objs)
    assert "Job" not in {o["kind"] for o in objs}, "tiny models need no pull job"
    for obj in objs:
        _validate(obj)
    echo = parse_topology("workers:\n  - {role: llm, program: echo}\n")
    with pytest.raises(InvalidArgument, match="test program"):
        render(echo)


def test_cli_renders_the_committed_manifests(tmp_path: Path) -> None:
    """`omniflow deploy k8s` prints what deploy/k8s/omniflow.yaml holds (kept in step)."""
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli.main", "deploy", "k8s"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    committed = (ROOT / "deploy" / "k8s" / "omniflow.yaml").read_text()
    assert proc.stdout == committed, (
        "regenerate: omniflow deploy k8s --out deploy/k8s/omniflow.yaml"
    )
    docs = [d for d in yaml.safe_load_all(committed) if d]
    assert to_yaml(docs) in committed
