"""Two nodes on their own network addresses: network namespaces joined by a veth pair.

The test makes two namespaces (`ip netns`), a veth pair between them with addresses from
the benchmarking range 198.18.0.0/15 (which routes nowhere), and starts, as real
processes inside them: on node A a Redis, the kv-index, a kv-agent and an llm worker
(SmolLM2-135M), on node B a kv-agent and an llm worker. Every process binds and
advertises its node's address (OMNIFLOW_HOST / OMNIFLOW_ADVERTISE_HOST), runs mutual TLS
with a certificate that carries that address, and the kv-agents' NIXL listeners use only
the veth device. A prompt prefilled on A is then asked on B: B's worker reuses A's pages
(cached_tokens), pulled agent to agent across the veth link (its byte counters). The link
is shaped with `tc tbf` to 10 Gbit/s, then 1 Gbit/s; the time to first token of reuse and
of recompute (a fresh prompt of the same length) at each rate is printed (-s), never
asserted. Everything made is removed at the end: processes by PID, namespaces, files.

Needs root, `ip`, `tc`, redis-server and the smollm2-135m-instruct model source.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.security.bundle import make_bundle
from omniflow.security.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

A_IP, B_IP = "198.18.0.1", "198.18.0.2"
MODEL = "smollm2-135m-instruct"


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> str:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    proc = subprocess.run(full, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {proc.stderr.strip()}")
    return proc.stdout


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc", "redis-server"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = f"of-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create network namespaces here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    try:
        from omniflow.models.resolve import resolve_model

        resolve_model(MODEL)
    except Exception as exc:  # the wheel is missing, or the conversion failed
        return f"needs the {MODEL} model source ({exc})"
    return None


class Node:
    """The processes started in one namespace, by name."""

    def __init__(self, ns: str, ip: str, root: Path) -> None:
        self.ns, self.ip, self.root = ns, ip, root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.root / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "env", *[f"{k}={v}" for k, v in env.items()],
                 *argv],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")},
            )  # fmt: skip

    def wait_ready(self, name: str, timeout_s: float = 300) -> str:
        ready = self.root / f"{name}.ready.json"
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.procs[name].poll() is not None:
                log = (self.root / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited:\n{log}")
            if ready.exists():
                return str(json.loads(ready.read_text())["address"])
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready in {timeout_s}s")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def link(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two namespaces and the veth pair between them; removed afterwards."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, va, vb = f"of-a-{tag}", f"of-b-{tag}", f"ofa{tag}", f"ofb{tag}"
    try:
        _sh("ip", "netns", "add", ns_a)
        _sh("ip", "netns", "add", ns_b)
        _sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        _sh("ip", "link", "set", va, "netns", ns_a)
        _sh("ip", "link", "set", vb, "netns", ns_b)
        for ns, dev, ip in ((ns_a, va, A_IP), (ns_b, vb, B_IP)):
            _sh("ip", "addr", "add", f"{ip}/30", "dev", dev, ns=ns)
            _sh("ip", "link", "set", dev, "up", ns=ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
        yield {"a": ns_a, "b": ns_b, "va": va, "vb": vb, "tag": tag}
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # veth goes too


@pytest.fixture(scope="module")
def nodes(link: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("netns")
    pki = root / "pki"
    idents = {
        "kv-index": Identity("kv-index", "a", "kv-index"),
        "kv-agent-a": Identity("kv-agent", "a", "kv-agent-a"),
        "llm-a": Identity("worker", "a", "llm-a"),
        "kv-agent-b": Identity("kv-agent", "b", "kv-agent-b"),
        "llm-b": Identity("worker", "b", "llm-b"),
        "client": Identity("client", "b", "client"),
    }
    bundle = make_bundle(pki, list(idents.values()), [":admin"], dns=(A_IP, B_IP))
    a, b = Node(link["a"], A_IP, root), Node(link["b"], B_IP, root)
    py = [sys.executable, "-m"]
    password = uuid.uuid4().hex
    redis_url = f"redis://:{password}@{A_IP}:6390/0"

    def env(name: str, node: Node, **extra: str) -> dict[str, str]:
        return {
            **bundle.env_for(idents[name]),
            "OMNIFLOW_HOST": node.ip, "OMNIFLOW_ADVERTISE_HOST": node.ip, "OMNIFLOW_PORT": "0",
            "OMNIFLOW_DISCOVERY": "redis", "OMNIFLOW_REDIS_URL": redis_url,
            "OMNIFLOW_METRICS_PORT": "-1", "OMNIFLOW_INSTANCE_ID": name,
            "OMNIFLOW_NODE_ID": "a" if node is a else "b",
            "OMNIFLOW_READY_FILE": str(root / f"{name}.ready.json"), **extra,
        }  # fmt: skip

    try:
        a.start("redis", ["redis-server", "--bind", A_IP, "--port", "6390", "--save", "",
                          "--appendonly", "no", "--dir", str(root), "--requirepass", password],
                {})  # fmt: skip
        for _ in range(100):
            pong = _sh(
                "redis-cli",
                "-h",
                A_IP,
                "-p",
                "6390",
                "-a",
                password,
                "--no-auth-warning",
                "ping",
                ns=link["a"],
                check=False,
            )
            if "PONG" in pong:
                break
            time.sleep(0.05)
        a.start("kv-index", [*py, "omniflow_services.kv_index"], env("kv-index", a))
        index = a.wait_ready("kv-index")
        agents = {}
        for name, node in (("kv-agent-a", a), ("kv-agent-b", b)):
            node.start(name, [*py, "omniflow_services.kv_agent"],
                       env(name, node, OMNIFLOW_KV_INDEX_ADDR=index,
                           OMNIFLOW_KV_HOST_BYTES=str(256 << 20),
                           OMNIFLOW_KV_SHM_TAG=f"{link['tag']}{name[-1]}",
                           # Both namespaces share one kernel: UCX would move the pages by
                           # cross-memory attach, past the link; TCP crosses the veth.
                           UCX_TLS="tcp"))  # fmt: skip
        for name, node in (("kv-agent-a", a), ("kv-agent-b", b)):
            agents[name] = node.wait_ready(name)
        for name, node, agent in (("llm-a", a, "kv-agent-a"), ("llm-b", b, "kv-agent-b")):
            node.start(name, [*py, "omniflow_services.worker"],
                       env(name, node, OMNIFLOW_KV_AGENT_ADDR=agents[agent],
                           OMNIFLOW_WORKER_ROLE="llm", OMNIFLOW_WORKER_MODEL=MODEL,
                           OMNIFLOW_NODE_TORCH_WORKERS="2"))  # fmt: skip
        workers = {n: node.wait_ready(n, 600) for n, node in (("llm-a", a), ("llm-b", b))}
        client_env = {**bundle.env_for(idents["client"]), "OMNIFLOW_TOKEN": bundle.tokens[":admin"]}
        yield {"a": a, "b": b, "workers": workers, "agents": agents, "index": index,
               "client_env": client_env, "link": link, "root": root}  # fmt: skip
    finally:
        b.stop()
        a.stop()
        for f in Path("/dev/shm").glob(f"omniflow-*{link['tag']}*"):
            f.unlink(missing_ok=True)


CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
    from omniflow.rpc.client import open_channel

    async def gen(addr, text):
        async with open_channel(addr, default_timeout_s=300) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            t0, first, usage = time.perf_counter(), None, None
            req = worker_pb2.GenerateRequest(text=text, sampling={"max_tokens": 1})
            async for chunk in stub.Generate(req, timeout=300):
                if first is None:
                    first = time.perf_counter()
                if chunk.usage.prompt_tokens:
                    usage = chunk.usage
            return {"ttft_ms": (first - t0) * 1e3, "prompt": usage.prompt_tokens,
                    "cached": usage.cached_tokens}

    args = json.loads(sys.argv[1])
    print(json.dumps(asyncio.run(gen(args["addr"], args["text"]))))
    """
)


def _generate(nodes: dict, ns_key: str, worker: str, text: str) -> dict:
    node = nodes[ns_key]
    arg = json.dumps({"addr": nodes["workers"][worker], "text": text})
    env = [f"{k}={v}" for k, v in nodes["client_env"].items()]
    out = subprocess.run(
        ["ip", "netns", "exec", node.ns, "env", *env, sys.executable, "-c", CLIENT, arg],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _prompt(seed: int, words: int = 700) -> str:
    import random

    rng = random.Random(seed)
    vocab = "river stone light market engine garden silver number window thunder paper orbit"
    vocab = [*vocab.split(), "candle", "harbor", "violet", "copper"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _veth_bytes(nodes: dict) -> int:
    link = nodes["link"]
    raw = _sh("cat", f"/sys/class/net/{link['vb']}/statistics/rx_bytes", ns=link["b"])
    return int(raw.strip())


def _listeners(ns: str) -> set[str]:
    out = _sh("ss", "-ltnH", ns=ns)
    hosts = {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}
    # gRPC's dual-stack sockets list an IPv4 address as IPv4-mapped IPv6.
    return {h.removeprefix("[::ffff:").removesuffix("]") for h in hosts}


def test_every_service_listens_on_its_node_address(nodes: dict) -> None:
    link = nodes["link"]
    assert _listeners(link["a"]) <= {A_IP}, _listeners(link["a"])
    assert _listeners(link["b"]) <= {B_IP}, _listeners(link["b"])
    assert all(v.startswith(A_IP) for v in (nodes["index"], nodes["workers"]["llm-a"]))
    assert nodes["workers"]["llm-b"].startswith(B_IP)


def test_prefix_prefilled_on_a_is_reused_on_b_at_10_and_1_gbit(nodes: dict) -> None:
    link = nodes["link"]
    results: dict[str, dict[str, list[float]]] = {}
    for rate in ("10gbit", "1gbit"):
        for ns, dev in ((link["a"], link["va"]), (link["b"], link["vb"])):
            _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "4mb", "latency", "200ms", ns=ns)  # fmt: skip
        reuse, recompute = [], []
        for rep in range(2):
            seed = (1 if rate == "10gbit" else 2) * 100 + rep
            text = _prompt(seed)
            first = _generate(nodes, "a", "llm-a", text)  # prefill on A
            assert first["cached"] == 0
            time.sleep(1.0)  # A's pages reach its agent and the index
            before = _veth_bytes(nodes)
            again = _generate(nodes, "b", "llm-b", text)
            moved = _veth_bytes(nodes) - before
            assert again["prompt"] == first["prompt"]
            assert again["cached"] >= first["prompt"] // 2, (first, again)
            assert moved > again["cached"] * 1000, f"only {moved} bytes crossed the veth"
            fresh = _generate(nodes, "b", "llm-b", _prompt(seed + 50))
            assert fresh["cached"] < fresh["prompt"] // 4
            reuse.append(again["ttft_ms"])
            recompute.append(fresh["ttft_ms"])
        results[rate] = {
            "reuse_ms": reuse,
            "recompute_ms": recompute,
            "prompt_tokens": [first["prompt"]],
            "cached_tokens": [again["cached"]],
        }
    print("\nnetns TTFT (ms) of a prompt prefilled on node A, asked on node B:")
    print(json.dumps(results, indent=1))
