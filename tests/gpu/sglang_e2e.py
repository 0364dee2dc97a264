"""End-to-end check of the SGLang backend on a GPU machine (run by run_sglang_e2e.sh).

Starts a private Redis, a kv-index, a kv-agent and two llm workers with
``OMNIFLOW_WORKER_ENGINE=sglang`` on one model (a Qwen2.5-0.5B folder when given, else a
tiny Qwen2 made by ``make_tiny``), then through the worker API:

1. worker A streams a greedy reply to a long prompt; the reply is checked (tokens, text,
   finish reason, usage) and a repeat is identical with cached tokens (SGLang's radix cache);
2. SGLang's own ``get_hash_str`` chain equals ``sglang_page_keys`` (the key mapping);
3. worker A reports the chain's block hashes of the prompt, and its pages reached the
   kv-agent through the HiCache backend under them (SGLang's keys mapped by the worker's
   key table): the agent holds the hashes A reported (``LocatePages`` in A's namespace);
4. worker B, which never saw the prompt, serves it with cached tokens loaded from the agent
   (HiCache prefetch from the storage tier) and the same greedy reply.

Prints a short report; exits 1 when a required check fails. Every process it starts is
ended by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from omniflow.api.common.v1 import common_pb2
from omniflow.api.kvagent.v1 import kvagent_pb2, kvagent_pb2_grpc
from omniflow.api.worker.v1 import worker_pb2, worker_pb2_grpc
from omniflow.kv.blocks import block_hashes
from omniflow.localredis import find_redis_server, start_redis
from omniflow.models.tiny import make_tiny
from omniflow_services.worker.sglang.pages import sglang_page_keys

REPORT: list[tuple[str, str, str]] = []  # (check, result, detail)


def note(check: str, ok: bool | None, detail: str) -> None:
    REPORT.append((check, {True: "PASS", False: "FAIL", None: "INFO"}[ok], detail))
    print(f"[{REPORT[-1][1]}] {check}: {detail}", flush=True)


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, module: str, name: str, env: dict[str, str], timeout_s: float) -> str:
        ready, log = self.tmp / f"{name}.ready.json", self.tmp / f"{name}.log"
        full = {
            **os.environ,
            "OMNIFLOW_DISCOVERY": "redis",
            "OMNIFLOW_PORT": "0",
            "OMNIFLOW_METRICS_PORT": "-1",
            "OMNIFLOW_READY_FILE": str(ready),
            "OMNIFLOW_INSTANCE_ID": name,
            **env,
        }
        with open(log, "wb") as out:
            p = subprocess.Popen(
                [sys.executable, "-m", f"omniflow_services.{module}"],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # SGLang's scheduler processes go with it
            )
        self.started.append((name, p))
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited {p.returncode}:\n{log.read_text()[-4000:]}")
            if ready.exists():
                return json.loads(ready.read_text())["address"]
            time.sleep(0.2)
        raise RuntimeError(f"{name} not ready in {timeout_s}s:\n{log.read_text()[-4000:]}")

    def stop(self) -> None:
        for _, p in reversed(self.started):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(self.started):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"{name} ignored SIGTERM; killing its process group", flush=True)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


async def generate(address: str, ids: list[int], max_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        tokens: list[int] = []
        text, last, chunks = "", None, 0
        async for r in stub.Generate(req, timeout=300):
            tokens += list(r.token_ids)
            text += r.text
            chunks += 1
            last = r
        assert last is not None
        return {
            "tokens": tokens,
            "text": text,
            "chunks": chunks,
            "finish": worker_pb2.FinishReason.Name(last.finish_reason),
            "prompt": last.usage.prompt_tokens,
            "cached": last.usage.cached_tokens,
            "completion": last.usage.completion_tokens,
            "hashes": list(last.prompt_block_hashes),
        }


async def info(address: str) -> common_pb2.WorkerInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(
            worker_pb2.GetInfoRequest(), timeout=30
        )
        return reply.info


async def agent_holds(address: str, namespace: str, hashes: list[bytes]) -> tuple[int, dict]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = kvagent_pb2_grpc.KVAgentServiceStub(ch)
        loc = await stub.LocatePages(
            kvagent_pb2.LocatePagesRequest(namespace=namespace, block_hashes=hashes), timeout=30
        )
        if loc.pin_id:
            await stub.Unpin(kvagent_pb2.UnpinRequest(pin_id=loc.pin_id), timeout=30)
        stats = await stub.Stats(kvagent_pb2.StatsRequest(), timeout=30)
        tiers = {common_pb2.Tier.Name(t.tier): t.pages for t in stats.tiers}
        return len(loc.slots), tiers


def check_key_chain(ids: list[int], page_size: int) -> None:
    try:
        from sglang.srt.mem_cache.utils import get_hash_str  # type: ignore[import-not-found]
    except ImportError:
        try:
            from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
                get_hash_str,
            )
        except ImportError:
            note("key chain", None, "SGLang's get_hash_str not found at the known paths")
            return
    theirs, prior = [], None
    for start in range(0, len(ids) // page_size * page_size, page_size):
        prior = get_hash_str(ids[start : start + page_size], prior_hash=prior)
        theirs.append(prior)
    ours = sglang_page_keys(ids, page_size)
    note("key chain", theirs == ours, f"{len(ours)} page keys equal SGLang's get_hash_str")


async def run(args: argparse.Namespace, tmp: Path, procs: Procs) -> None:
    sg = args.engine == "sglang"
    if sg:
        import sglang  # noqa: F401 - fail early with the import error

    if args.model:
        model = Path(args.model)
    else:
        model = make_tiny(
            "qwen2", tmp / "tiny-qwen2", layers=4, hidden=256, heads=4, kv_heads=2,
            vocab=512, max_position=4096, dtype="bfloat16",
        )  # fmt: skip
    note("model", None, str(model))
    redis = start_redis(dir=tmp / "redis", binary=find_redis_server())
    try:
        env = {"OMNIFLOW_REDIS_URL": redis.url}
        index = procs.spawn("kv_index", "kvi", env, 60)
        agent = procs.spawn(
            "kv_agent",
            "kva",
            {**env, "OMNIFLOW_KV_INDEX_ADDR": index, "OMNIFLOW_KV_HOST_BYTES": str(2 << 30)},
            60,
        )
        wenv = {
            **env,
            "OMNIFLOW_WORKER_ENGINE": args.engine,
            "OMNIFLOW_WORKER_MODEL": str(model),
            "OMNIFLOW_WORKER_DTYPE": "bfloat16",
            "OMNIFLOW_KV_AGENT_ADDR": agent,
        }
        t0 = time.monotonic()
        wa = procs.spawn("worker", "llm-a", wenv, args.load_timeout)
        note("worker A", True, f"SERVING at {wa} after {time.monotonic() - t0:.0f}s")
        ia = await info(wa)
        note("namespace", None, f"worker A kv_namespace {ia.kv_namespace}")

        ids = [(7 * i + 3) % 500 + 1 for i in range(args.prompt_tokens)]
        r1 = await generate(wa, ids, 16)
        ok = (
            r1["completion"] == len(r1["tokens"]) > 0
            and r1["finish"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
            and r1["prompt"] == len(ids)
        )
        note(
            "generate",
            ok,
            f"{len(r1['tokens'])} tokens in {r1['chunks']} chunks, {r1['finish']}, "
            f"usage prompt={r1['prompt']} cached={r1['cached']}, text={r1['text'][:60]!r}",
        )
        r2 = await generate(wa, ids, 16)
        note(
            "repeat (device cache)",
            r2["tokens"] == r1["tokens"] and r2["cached"] > 0,
            f"same reply={r2['tokens'] == r1['tokens']}, cached_tokens={r2['cached']}",
        )
        if not sg:  # a CPU dry run of the harness: the SGLang checks do not apply
            note("sglang checks", None, "skipped: --engine torch")
            return
        check_key_chain(ids, 16)
        hashes = r1["hashes"]
        chain = block_hashes(bytes.fromhex(ia.kv_namespace), ids, 16)
        note(
            "chain names",
            hashes == chain,
            "the prompt's pages are named by the chain's block hashes (sglang.pages.KeyTable)",
        )
        held, tiers = 0, {}
        for _ in range(60):  # write-through to storage runs in SGLang's backup thread
            held, tiers = await agent_holds(agent, ia.kv_namespace, hashes)
            if held == len(hashes):
                break
            await asyncio.sleep(0.5)
        note(
            "pages reached the kv-agent",
            held > 0,
            f"{held}/{len(hashes)} prompt pages held by the agent in namespace "
            f"{ia.kv_namespace[:12]}…; agent tiers {tiers}",
        )
        if args.second_worker:
            wb = procs.spawn("worker", "llm-b", wenv, args.load_timeout)
            r3 = await generate(wb, ids, 16)
            note(
                "worker B reuses A's pages",
                r3["tokens"] == r1["tokens"] and r3["cached"] > 0,
                f"same reply={r3['tokens'] == r1['tokens']}, cached_tokens={r3['cached']} "
                f"of {r3['prompt']} (loaded from the agent by HiCache prefetch)",
            )
    finally:
        procs.stop()
        redis.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("OMNIFLOW_E2E_MODEL", ""))
    ap.add_argument("--prompt-tokens", type=int, default=600)  # > SGLang's prefetch threshold
    ap.add_argument("--load-timeout", type=float, default=420.0)
    ap.add_argument("--engine", choices=("sglang", "torch"), default="sglang",
                    help="torch: a CPU dry run of this harness")  # fmt: skip
    ap.add_argument("--no-second-worker", dest="second_worker", action="store_false")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-sglang-e2e-"))
    procs = Procs(tmp)
    try:
        asyncio.run(run(args, tmp, procs))
    except Exception as exc:
        note("run", False, f"{type(exc).__name__}: {exc}")
    finally:
        procs.stop()
    print("\n== SGLang backend end-to-end report ==")
    for check, result, detail in REPORT:
        print(f"{result:4}  {check:28} {detail}")
    print(f"logs: {tmp}")
    return 1 if any(r == "FAIL" for _, r, _ in REPORT) else 0


if __name__ == "__main__":
    sys.exit(main())
