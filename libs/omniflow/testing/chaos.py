"""A chaos run against a real local topology (``omniflow up``, supervised), for the chaos
test and ``bench/chaos.py``.

The topology serves TEST echo workers (fake compute, no model), so a run costs little:
an llm "generation" streams ``echo: <prompt>`` word by word — or, with ``model`` (e.g.
``smollm2-135m-instruct``), real llm workers: the engine on real weights, greedy, a few
tokens per request, sharing KV through the kv-agent. Load is a mix of workflow
runs (client → coordinator → router → worker), direct generations (client → the
router's worker proxy → worker), OpenAI completions and chat completions of the llm model
(client → gateway → router's Pick → worker) and chat completions of the workflow model
(client → gateway → coordinator → ...), all greedy, each checked against the answer
recorded before any fault. One phase per service: while requests are in flight, that
service is SIGKILLed; the supervisor restarts it with nobody's help.

Each request ends as one of:

- ``ok``: the right output at the first try;
- ``retried``: the system reported a failure with a reason (a run adopted after its
  coordinator died, a record Redis could not take, a router that did not answer) and
  the client, like a well-behaved one, submitted again and got the right output;
- ``wrong``: an output that differs from the recorded answer;
- ``lost``: no answer the client could act on (it never heard how the request ended, or
  the retries ran out), or a run still RUNNING in Redis once the adoption window passed.

Recovery: seconds from the kill until a fresh request of each kind (submitted after the
kill, no retries) succeeds; probed every ``probe_interval_s`` for up to ``window_s``. The
``none`` target kills nothing: its recovery is what the load alone costs a fresh request
(with real workers on few cores, the queue it waits behind), the baseline of the others.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.backoff import Backoff
from omniflow.client import Client
from omniflow.dsl import Retry, VType, Workflow
from omniflow.errors import OmniflowError
from omniflow.localredis import redis_client
from omniflow.rpc.client import open_channel
from omniflow.security.local import client_record, use_local_security
from omniflow.security.transport import configure as configure_security

KILL_ORDER = ("llm-1", "kv-agent", "router", "coordinator", "kv-index", "redis")
#: A target that kills nothing: the control phase (the same load, its "recovery" is how
#: long a fresh request waits behind the load alone).
NO_FAULT = "none"
WORKFLOW = "chaos"
# A well-behaved client's retries: backoff doubling from 0.25 s, capped at 2 s, six times
# (about 8 s in all: a single restarted service is back within the 10 s window).
RETRIES = 6
MAX_BACKOFF_S = 2.0
#: How often a phase probes, after its kill, whether both kinds of request answer again.
RECOVERY_PROBE_S = 0.5


# Prompts for a real model: a shared context several KV pages long (16 tokens a page), so
# that requests reuse pages through the kv-agent and a worker restarted mid-phase reads
# them back; each ends where a greedy continuation of a few tokens is plain text.
_CONTEXT = (
    "Omni-Flow is a system of small services. A router picks a worker for each call, a "
    "coordinator runs workflows made of such calls, and every node keeps a cache of the "
    "attention keys and values of recent prompts, so that a prompt that starts like an "
    "earlier one does not have to be computed again. "
)
REAL_PROMPTS = [
    _CONTEXT + "In one sentence, the router's job is to",
    _CONTEXT + "The three primary colors are",
    _CONTEXT + "Once upon a time, in a small village,",
    _CONTEXT + "Q: What is the capital of France?\nA:",
]


def chaos_workflow(max_tokens: int = 0) -> Workflow:
    wf = Workflow(WORKFLOW, description="one llm generation (chaos test)")
    params = {"max_tokens": max_tokens} if max_tokens else None
    # A retry policy, as a user gives a node that may meet a dying worker: another worker
    # takes the call when the first fails before any output.
    reply = wf.call(
        "say", "llm", "generate", prompt=wf.input("prompt", VType.TEXT),
        retry=Retry(max_attempts=3), params=params,
    )  # fmt: skip
    wf.output("text", reply["text"])
    return wf


class GatewayError(Exception):
    """The gateway answered with another status than 200."""


@dataclass(slots=True)
class PhaseResult:
    """What one killed service did to the requests in flight around it."""

    killed: str
    counts: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "retried": 0, "lost": 0, "wrong": 0}
    )
    recovery_s: float | None = None  # None: not within the window
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class LocalTopology:
    """``omniflow up`` in a run folder of its own, with echo workers (or real llm workers
    serving ``model``); ``down`` at exit."""

    def __init__(
        self,
        root: Path,
        *,
        workers: int = 2,
        replicas: int = 1,
        token_delay_ms: float = 20.0,
        model: str = "",
        gateways: int = 1,
    ) -> None:
        self.root = root
        self.replicas = replicas
        self.gateways = gateways
        self.model = model
        self.run_dir = root / "run"
        omniflow = shutil.which("omniflow") or str(Path(sys.executable).with_name("omniflow"))
        self._omniflow = omniflow
        self.env = {
            **os.environ,
            "OMNIFLOW_RUN_DIR": str(self.run_dir),
            "OMNIFLOW_GATEWAY_PORT": "0",
            "OMNIFLOW_REGISTRATION_TTL_S": "2",  # also the coordinators' lease TTL
            "OMNIFLOW_ECHO_TOKEN_DELAY_MS": str(token_delay_ms),
            "OMP_NUM_THREADS": "1",
        }
        self.env.pop("OMNIFLOW_REDIS_URL", None)
        self.env.pop("OMNIFLOW_COORDINATOR_ADDR", None)
        self.workers = workers

    def _cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self._omniflow, *args], env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def up(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        topology = self.root / "topology.yaml"
        worker = "program: echo"
        if not self.model:  # the gateway tokenizes for the echo model with a tiny tokenizer
            from omniflow.models.tiny import make_tiny

            make_tiny("qwen2", self.root / "models" / "echo")
            self.env["OMNIFLOW_MODELS_DIR"] = str(self.root / "models")
        if self.model:  # one torch thread each; a small KV pool (prompts are short)
            env = "{OMNIFLOW_WORKER_TORCH_THREADS: '1', OMNIFLOW_WORKER_KV_BYTES: '33554432'}"
            worker = f'model: "{self.model}", env: {env}'
        topology.write_text(
            f"node: chaos\nrouters: {self.replicas}\ncoordinators: {self.replicas}\n"
            f"gateways: {self.gateways}\n"
            f"workers:\n  - {{role: llm, count: {self.workers}, {worker}}}\n"
        )
        # Real workers load their weights before `up` returns.
        done = self._cli("up", "--topology", str(topology), timeout=600 if self.model else 180)
        if done.returncode != 0:
            self.down()
            raise RuntimeError(f"omniflow up failed:\n{done.stdout}\n{done.stderr}")

    def down(self) -> str:
        return self._cli("down", timeout=120).stdout

    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.run_dir / "state.json").read_text()))

    def procs(self) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.state()["procs"]}

    def all_pids(self) -> set[int]:
        state = self.state()
        return {p["pid"] for p in state["procs"]} | {state.get("supervisor", 0)} - {0}

    def kill(self, name: str) -> int:
        pid = int(self.procs()[name]["pid"])
        os.kill(pid, signal.SIGKILL)
        return pid

    def healthy(self) -> bool:
        return self._cli("status", timeout=60).returncode == 0

    @property
    def redis_url(self) -> str:
        return str(self.state()["env"]["OMNIFLOW_REDIS_URL"])

    def addresses(self, service: str) -> list[str]:
        """Addresses of every replica of ``service``, the first-started first."""
        return [str(p["address"]) for p in self.procs().values() if p["service"] == service]

    @property
    def served_model(self) -> str:
        """The model name the gateway serves the llm workers' model as."""
        return Path(self.model).name if self.model else "echo"


class Load:
    """The two kinds of request, each with the retries of a well-behaved client."""

    def __init__(
        self,
        topo: LocalTopology,
        client: Client,
        *,
        max_tokens: int = 0,
        timeout_s: float = 10.0,
        probe_timeout_s: float = 3.0,
    ) -> None:
        self.topo = topo
        self.client = client
        self.coordinators = ",".join(topo.addresses("coordinator"))
        self.expected: dict[str, str] = {}  # workflow answers, recorded before any fault
        self.expected_direct: dict[str, str] = {}  # direct answers (a real model's may differ)
        self.expected_gateway: dict[str, str] = {}  # completions through the gateway
        self.expected_chat: dict[str, str] = {}  # chat completions of the llm model
        self.gateway_url = topo.addresses("gateway")[0]
        self.gateway_key = client_record(topo.run_dir).get("gateway_api_key", "")
        self.run_ids: list[str] = []
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s  # of one direct generation
        self.probe_timeout_s = probe_timeout_s

    def direct_answer(self, prompt: str) -> str:
        return self.expected_direct.get(prompt, self.expected[prompt])

    async def workflow(self, prompt: str, retries: int = RETRIES) -> tuple[str, str]:
        """(outcome, detail) of one workflow run."""
        backoff = Backoff(0.25, MAX_BACKOFF_S)
        why = ""
        for attempt in range(retries + 1):
            run_id = uuid.uuid4().hex
            self.run_ids.append(run_id)
            try:
                final = None
                async for ev in self.client.stream(WORKFLOW, {"prompt": prompt}, run_id=run_id):
                    if ev.HasField("run_finished"):
                        final = ev.run_finished
                if final is None:
                    return "lost", f"run {run_id}: stream ended without RunFinished"
            except OmniflowError as exc:
                why = f"run {run_id}: {type(exc).__name__}: {exc}"
                if attempt == retries:
                    return "lost", why
                await backoff.wait()
                continue
            if final.state == cpb.RUN_STATE_SUCCEEDED:
                text = final.outputs["text"].text
                if text != self.expected[prompt]:
                    return "wrong", f"run {run_id}: {text!r} != {self.expected[prompt]!r}"
                return ("ok", "") if attempt == 0 else ("retried", why)
            why = f"run {run_id}: {final.error or 'failed with no reason'}"
            if not final.error or attempt == retries:
                return "lost", why
            await backoff.wait()  # a failure with a reason: submit again
        return "lost", "unreachable"

    async def _generate_once(self, prompt: str, timeout_s: float, router: int = 0) -> str:
        routers = self.topo.addresses("router")
        address = routers[router % len(routers)]
        async with open_channel(address, default_timeout_s=timeout_s) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            parts = []
            req = worker_pb2.GenerateRequest(request_id=uuid.uuid4().hex, text=prompt)
            if self.max_tokens:
                req.sampling.max_tokens = self.max_tokens
            async for chunk in stub.Generate(req, timeout=timeout_s):
                parts.append(chunk.text)
            return "".join(parts)

    async def direct(self, prompt: str, retries: int = RETRIES) -> tuple[str, str]:
        """(outcome, detail) of one generation through the router's worker proxy. An
        attempt tries each router replica in turn (failover, not a retry); a retry comes
        after every replica failed, with backoff."""
        backoff = Backoff(0.25, MAX_BACKOFF_S)
        why = ""
        for attempt in range(retries + 1):
            for router in range(self.topo.replicas):
                try:
                    text = await self._generate_once(prompt, self.timeout_s, router)
                except (OmniflowError, OSError) as exc:  # the channel's domain errors
                    code = exc.code_name if isinstance(exc, OmniflowError) else ""
                    why = f"direct: {code} {exc}"
                    continue
                if text != self.direct_answer(prompt):
                    return "wrong", f"direct: {text!r} != {self.direct_answer(prompt)!r}"
                return ("ok", "") if attempt == 0 else ("retried", why)
            if attempt < retries:
                await backoff.wait()
        return "lost", why

    async def _complete_once(self, prompt: str, timeout_s: float, kind: str = "text") -> str:
        """A completion of ``prompt`` by the gateway; ``kind`` "chat": a chat turn of the llm
        model, "workflow": of the workflow model (``workflow:chaos``, whose answer is the
        workflow's), else a text completion."""
        import httpx  # a test harness: the dev extra's HTTP client

        chat = kind in ("chat", "workflow")
        model = f"workflow:{WORKFLOW}" if kind == "workflow" else self.topo.served_model
        body: dict[str, Any] = {"model": model}
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        if kind != "workflow":
            body["temperature"] = 0.0
            if self.max_tokens:
                body["max_tokens"] = self.max_tokens
        headers = {"authorization": f"Bearer {self.gateway_key}"} if self.gateway_key else {}
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            reply = await http.post(f"{self.gateway_url}{path}", json=body, headers=headers)
        if reply.status_code != 200:
            raise GatewayError(f"HTTP {reply.status_code}: {reply.text[:200]}")
        choice = reply.json()["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])

    async def gateway(
        self, prompt: str, retries: int = RETRIES, kind: str = "text"
    ) -> tuple[str, str]:
        """(outcome, detail) of one completion through the gateway (``kind``: see
        ``_complete_once``); an answer that is not a 200 (or no answer) is retried with
        backoff, as a well-behaved client does."""
        answers = {"workflow": self.expected, "chat": self.expected_chat}
        expected = answers.get(kind, self.expected_gateway)[prompt]
        backoff = Backoff(0.25, MAX_BACKOFF_S)
        why = ""
        for attempt in range(retries + 1):
            try:
                text = await self._complete_once(prompt, self.timeout_s, kind)
            except (GatewayError, OSError, TimeoutError, RuntimeError) as exc:
                why = f"gateway {kind}: {type(exc).__name__}: {exc}"
                if attempt < retries:
                    await backoff.wait()
                continue
            if text != expected:
                return "wrong", f"gateway {kind}: {text!r} != {expected!r}"
            return ("ok", "") if attempt == 0 else ("retried", why)
        return "lost", why

    async def gateway_workflow(self, prompt: str) -> tuple[str, str]:
        return await self.gateway(prompt, kind="workflow")

    async def gateway_chat(self, prompt: str) -> tuple[str, str]:
        return await self.gateway(prompt, kind="chat")

    async def probe(self) -> tuple[bool, bool]:
        """One fresh request of each kind with no retry: (workflow ok, direct ok)."""
        prompt = next(iter(self.expected))
        # A fresh client, failing over between replicas only as fast as it can (no backoff).
        wait = self.probe_timeout_s
        probe = Client(self.coordinators, failover_s=1.0, resume_s=wait, timeout_s=wait)
        try:
            wf = await asyncio.wait_for(probe.run(WORKFLOW, {"prompt": prompt}), wait)
            wf_ok = wf.ok and wf.outputs.get("text") == self.expected[prompt]
        except (OmniflowError, TimeoutError):
            wf_ok = False
        finally:
            await probe.close()
        direct_ok = False
        for router in range(self.topo.replicas):  # each replica once, as a client fails over
            try:
                text = await self._generate_once(prompt, self.probe_timeout_s, router)
                direct_ok = text == self.direct_answer(prompt)
            except (OmniflowError, OSError, TimeoutError):
                continue
            break
        return wf_ok, direct_ok


async def _recovery(load: Load, killed_at: float, window_s: float) -> float | None:
    seen = [False, False]
    end = killed_at + window_s
    while time.monotonic() < end:
        started = time.monotonic()
        for i, ok in enumerate(await load.probe()):
            seen[i] = seen[i] or ok
        if all(seen):
            return time.monotonic() - killed_at
        await asyncio.sleep(max(0.0, RECOVERY_PROBE_S - (time.monotonic() - started)))
    return None


async def run_phase(
    load: Load, target: str, requests: int, *, spacing_s: float = 0.08, window_s: float = 10.0
) -> PhaseResult:
    """Send ``requests`` (alternating kinds) ``spacing_s`` apart; SIGKILL ``target`` of the
    load's topology after a third of them started; wait for them all and for the recovery
    probes (up to ``window_s`` after the kill)."""
    result = PhaseResult(target)
    prompts = list(load.expected)
    tasks: list[asyncio.Task[tuple[str, str]]] = []
    recovery: asyncio.Task[float | None] | None = None
    for i in range(requests):
        prompt = prompts[i % len(prompts)]
        kinds: tuple[Callable[[str], Awaitable[tuple[str, str]]], ...] = (
            load.workflow,
            load.direct,
            load.gateway,
            load.gateway_chat,
            load.gateway_workflow,
        )
        kind = kinds[i % len(kinds)]
        tasks.append(asyncio.create_task(kind(prompt)))
        if i == requests // 3:
            if target != NO_FAULT:
                load.topo.kill(target)
            recovery = asyncio.create_task(_recovery(load, time.monotonic(), window_s))
        await asyncio.sleep(spacing_s)
    for outcome, detail in await asyncio.gather(*tasks):
        result.counts[outcome] += 1
        if detail:
            result.notes.append(detail)
    assert recovery is not None
    result.recovery_s = await recovery
    return result


async def stuck_runs(topo: LocalTopology, run_ids: list[str], wait_s: float) -> list[str]:
    """Runs still RUNNING (or active) once ``wait_s`` of adoption window passed."""
    db = redis_client(topo.redis_url, 5.0)
    try:
        end = time.monotonic() + wait_s
        stuck: list[str] = []
        while True:
            stuck = []
            active = {k.decode() for k in await db.hkeys("omniflow:runs:active")}
            for run_id in run_ids:
                raw = await db.get(f"omniflow:run:{run_id}")
                if raw is None:
                    if run_id in active:
                        stuck.append(run_id)
                    continue  # never accepted (its submission failed, and was retried)
                run = cpb.Run()
                run.ParseFromString(raw)
                if run.state in (cpb.RUN_STATE_RUNNING, cpb.RUN_STATE_PENDING):
                    stuck.append(run_id)
            if not stuck or time.monotonic() > end:
                return stuck
            await asyncio.sleep(0.5)
    finally:
        await db.aclose()


async def wait_healthy(topo: LocalTopology, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await asyncio.to_thread(topo.healthy):
            return True
        await asyncio.sleep(0.5)
    return False


async def chaos(
    root: Path,
    *,
    per_phase: int = 16,
    targets: tuple[str, ...] = KILL_ORDER,
    window_s: float = 10.0,
    replicas: int = 1,
    model: str = "",
    max_tokens: int = 8,
    spacing_s: float = 0.08,
    log: Callable[[str], None] = print,
    budget_s: float | None = None,
) -> ChaosResult:
    """The whole run: up, record answers, one phase per target, check nothing is stuck,
    down. ``model``: real llm workers serving it (``max_tokens`` each request), else echo
    workers. A phase that would start past ``budget_s`` from the start is skipped (listed
    in the result's ``skipped``)."""
    end = None if budget_s is None else time.monotonic() + budget_s
    skipped: list[str] = []
    topo = LocalTopology(root, replicas=replicas, model=model)
    topo.up()
    started = topo.all_pids()
    # `omniflow up` runs mutual TLS and auth: this process presents its run folder's client
    # certificate and admin token (and its own settings come back afterwards).
    secured = use_local_security(topo.run_dir)
    try:
        coordinators = ",".join(topo.addresses("coordinator"))
        async with Client(coordinators, resume_s=30.0) as client:
            tokens = max_tokens if model else 0
            await client.register(chaos_workflow(tokens))
            # Real generations queue behind each other on few cores: longer deadlines.
            load = Load(
                topo, client, max_tokens=tokens, timeout_s=30.0 if model else 10.0,
                probe_timeout_s=10.0 if model else 3.0,
            )  # fmt: skip
            # The answers, recorded before any fault.
            prompts = REAL_PROMPTS if model else [f"q{i} how are the pages today" for i in range(4)]
            for prompt in prompts:
                result = await client.run(WORKFLOW, {"prompt": prompt})
                if not result.ok:
                    raise RuntimeError(f"baseline run failed: {result.error}")
                load.expected[prompt] = result.outputs["text"]
                load.expected_direct[prompt] = await load._generate_once(prompt, load.timeout_s)
                load.expected_gateway[prompt] = await load._complete_once(prompt, load.timeout_s)
                load.expected_chat[prompt] = await load._complete_once(
                    prompt, load.timeout_s, "chat"
                )
            phases = []
            for target in targets:
                if end is not None and time.monotonic() > end:
                    log(f"phase {target}: skipped, past the time budget of {budget_s:.0f} s")
                    skipped.append(target)
                    continue
                kill = "no kill (control)" if target == NO_FAULT else f"SIGKILL {target}"
                log(f"phase: {kill} under load ...")
                phase = await run_phase(
                    load, target, per_phase, window_s=window_s, spacing_s=spacing_s
                )
                if not await wait_healthy(topo, 60.0):
                    phase.notes.append("topology not healthy again within 60 s")
                started |= topo.all_pids()
                phases.append(phase)
            stuck = await stuck_runs(topo, load.run_ids, wait_s=15.0)
    finally:
        started |= topo.all_pids()
        topo.down()
        if secured:
            configure_security(None)
        left = _reap_leftovers(started, topo.run_dir)
    return ChaosResult(phases, stuck, left, dict(load.expected), skipped)


@dataclass(slots=True)
class ChaosResult:
    phases: list[PhaseResult]
    stuck: list[str]  # runs left RUNNING after the adoption window
    left_behind: list[int]  # PIDs ``omniflow down`` did not end (ended here, by PID)
    answers: dict[str, str] = field(default_factory=dict)  # prompt -> text, before any fault
    skipped: list[str] = field(default_factory=list)  # targets past the time budget


def _reap_leftovers(pids: set[int], run_dir: Path) -> list[int]:
    """After ``down``: a process of this run still alive (should be none) is ended, by
    PID, once its environment or command line shows it belongs to ``run_dir``."""
    time.sleep(1.0)
    mine = str(run_dir).encode()
    left = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if mine in cmd or b"OMNIFLOW_RUN_DIR=" + mine + b"\0" in environ + b"\0":
            left.append(pid)
            os.kill(pid, signal.SIGKILL)
    return left


def table(phases: list[PhaseResult]) -> str:
    rows = [("killed", "requests", "ok", "retried", "lost", "wrong", "recovery s")]
    for p in phases:
        c = p.counts
        rec = "-" if p.recovery_s is None else f"{p.recovery_s:.1f}"
        rows.append((p.killed, str(p.total), str(c["ok"]), str(c["retried"]), str(c["lost"]),
                     str(c["wrong"]), rec))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
