"""Generated tokens/s of the built-in engine against vLLM (CPU) and transformers, one run.

The workload of issue 12: SmolLM2-135M-Instruct, random ``--prompt-len`` token prompts,
exactly ``--output-len`` greedy tokens each, all requests submitted at once, timed from
submission to the last token (prefill included), at each concurrency and dtype. vLLM runs in
its own virtualenv (``--vllm-python``, default ~/.cache/omniflow/venvs/vllm) as a subprocess
driving ``LLM.generate`` with the same token ids; the engine and transformers run here.

    python bench/engine_vs_vllm.py                             # 1, 8, 32 x bf16, fp32
    python bench/engine_vs_vllm.py --concurrency 1,8 --dtypes bfloat16 --rounds 3
    python bench/engine_vs_vllm.py --busy 1                    # a second process spins a core
    python bench/engine_vs_vllm.py --baseline cdd3cb8          # also the engine as of a commit

With fewer ``--threads`` than cores, every system is bound to the same first cores: our engine
and transformers by their process's CPU affinity, vLLM's OpenMP threads through
``VLLM_CPU_OMP_THREADS_BIND`` and, with ``--pin all`` (the default), all of vLLM's processes
by ``taskset`` (its API process and engine core would otherwise run on the other cores, which
our engine's single process cannot); ``--busy N`` spins N processes on those same cores, one
each: every system shares its cores with them alike.
Every system runs in a process of its own on the same prompts, started once per dtype; then
each level runs ``--rounds`` times per system, the systems taking turns (a slow minute of a
shared machine hits them alike), and each system's best run is kept. ``--baseline REF``
adds the worker package (the engine and what it imports) as it was at git ``REF``
(exported into a temporary folder that shadows the installed one): before/after in the
same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_MODEL = Path.home() / ".cache/omniflow/models/smollm2-135m-instruct"
DEFAULT_VLLM = Path.home() / ".cache/omniflow/venvs/vllm/bin/python"

# Runs inside the vLLM virtualenv: argv[1] is a JSON job; prints one JSON line of results.
VLLM_SCRIPT = r"""
import json, sys, time
job = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
          enable_prefix_caching=False, max_num_seqs=max(job["levels"]), seed=0,
          max_num_batched_tokens=job["budget"])
def go(prompts, n):
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == n * len(prompts), got
    return got / dt, [list(o.outputs[0].token_ids) for o in outs]
go([job["prompts"][str(job["levels"][0])][0]], 4)  # warm-up: a full-length prompt
print("READY", flush=True)
for line in sys.stdin:  # one level per line, answered with one run's result
    if line.strip() == "quit":
        break
    rate, toks = go(job["prompts"][line.strip()], job["output_len"])
    print("RESULT " + json.dumps({"tok_s": rate, "first": toks[0]}), flush=True)
"""


# Runs one system (our engine, or transformers) on every level: argv[1] is a JSON job;
# prints one JSON line. Every system runs in a fresh process of its own, like vLLM.
SYSTEM_SCRIPT = r"""
import json, sys, time, torch
job = json.loads(sys.argv[1])
if job["cores"]:  # the cores vLLM's threads are bound to
    import os
    os.sched_setaffinity(0, job["cores"])
torch.set_num_threads(job["threads"])
lv, n_out = job["levels"], job["output_len"]
prompts = job["prompts"]
if job["system"] == "engine":
    from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest
    from omniflow_services.worker.engine import SamplingParams
    import omniflow_services.worker.engine as mod
    assert mod.__file__.startswith(job["root"]), (mod.__file__, job["root"])
    per_req = -(-(job["prompt_len"] + n_out) // 16)
    cfg = EngineConfig(dtype=job["dtype"], num_pages=per_req * max(lv) + 8,
                       max_num_batched_tokens=job["budget"], max_num_seqs=max(64, max(lv)),
                       enable_prefix_cache=False, device=job["device"])
    e = Engine(job["model"], cfg)
    def go(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        first = []
        t = time.perf_counter()
        for i, p in enumerate(ps):
            e.add_request(GenerateRequest(f"r{i}", tuple(p), params=sp))
        got = 0
        while e.has_unfinished():
            for o in e.step():
                got += len(o.new_token_ids)
                if o.request_id == "r0":
                    first.extend(o.new_token_ids)
        assert got == n * len(ps)
        return got / (time.perf_counter() - t), first
else:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=getattr(torch, job["dtype"])).eval().to(job["device"])
    hf.generation_config.eos_token_id = None
    def go(ps, n):
        ids = torch.tensor(ps, device=job["device"])
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t
        return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt, out[0, ids.shape[1]:].tolist()
go([prompts[str(lv[0])][0]], 2)  # warm-up: a full-length prompt
print("READY", flush=True)
for line in sys.stdin:  # one level per line, answered with one run's result
    if line.strip() == "quit":
        break
    rate, first = go(prompts[line.strip()], n_out)
    print("RESULT " + json.dumps({"tok_s": rate, "first": first}), flush=True)
"""


class Peer:
    """One measured system in a process of its own, kept alive across levels and rounds:
    each ``run(level)`` is one timed run of that level's prompts (the process's first
    answer is READY, after loading and a warm-up). Killed with its whole session."""

    def __init__(self, what: str, cmd: list[str], env: dict[str, str], timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            start_new_session=True,
        )
        try:
            self._read("READY")
        except BaseException:  # a failed start or SIGTERM while starting: no process left
            self.close()
            raise

    def _read(self, want: str) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(want):
                return line[len(want) :].strip()
        self._err.seek(0)
        sys.stderr.write(self._err.read()[-4000:])
        self.close()
        raise RuntimeError(f"{self.what} gave no {want} within {self.timeout:.0f} s (stderr above)")

    def run(self, level: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{level}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # vLLM's engine process goes too
            self.proc.wait()
        self._err.close()


def start_system(
    args: argparse.Namespace,
    dtype: str,
    prompts: dict[int, list[list[int]]],
    system: str,
    ref: str,
    tmp: Path,
) -> Peer:
    """``system`` ("engine" or "hf") in a process of its own; the engine as of git ``ref``
    when given (exported into ``tmp``, a folder that shadows the installed package)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    pkg = repo / "services"
    if ref:
        tree = subprocess.run(
            ["git", "-C", str(repo), "archive", ref, "services/worker"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=tree, check=True)
        # services/ is the omniflow_services package; shadow the worker package as of ``ref``
        # (the engine imports the worker's llm interface package beside it).
        pkg = tmp / "omniflow_services"
        pkg.mkdir()
        (tmp / "services/worker").rename(pkg / "worker")
        (pkg / "__init__.py").write_text("")
        env["PYTHONPATH"] = str(tmp)
    job = {
        "system": system,
        "model": str(args.model),
        "dtype": dtype,
        "levels": list(prompts),
        "prompts": {str(k): v for k, v in prompts.items()},
        "output_len": args.output_len,
        "prompt_len": args.prompt_len,
        "budget": args.token_budget,
        "threads": args.threads,
        "device": args.device,
        "cores": bound_cores(args.threads),
        "root": str(pkg),
    }
    what = f"{system} {ref}".strip()
    return Peer(what, [sys.executable, "-c", SYSTEM_SCRIPT, json.dumps(job)], env, args.timeout)


def prompts_for(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + n)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def start_vllm(args: argparse.Namespace, dtype: str, prompts: dict[int, list[list[int]]]) -> Peer:
    job = {
        "model": str(args.model),
        "dtype": dtype,
        "levels": list(prompts),
        "prompts": {str(k): v for k, v in prompts.items()},
        "output_len": args.output_len,
        "max_model_len": args.prompt_len + args.output_len + 16,
        "budget": args.token_budget,
    }
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM binds one OpenMP thread per listed core: the cores our engine is bound to.
    cores = bound_cores(args.threads)
    bind = ",".join(map(str, cores)) if cores else "auto"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cmd = [str(args.vllm_python), "-c", VLLM_SCRIPT, json.dumps(job)]
    if cores and args.pin == "all":
        # every vLLM process (its API side and its engine core) on the measured cores, as
        # our engine's whole process is; "threads" binds only its OpenMP threads there.
        cmd = ["taskset", "-c", bind, *cmd]
    return Peer("vLLM", cmd, env, args.timeout)


def bound_cores(threads: int) -> list[int]:
    """The cores every system runs on with ``threads`` threads: the first ``threads`` of
    this process's cores, or [] (unbound, vLLM's "auto") when it uses them all."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[:threads] if threads < len(cores) else []


def _spin(core: int) -> None:
    """Busy on ``core``: one of the cores the measured systems run on."""
    os.sched_setaffinity(0, {core})
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    # SIGTERM unwinds like Ctrl-C: every system's process and the spinners are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="an HF folder")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=2048, help="tokens per step (both)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument(
        "--pin",
        choices=("threads", "all"),
        default="all",
        help="with fewer --threads than cores: vLLM's OpenMP threads only, or all its processes",
    )
    ap.add_argument(
        "--device", default="cpu", help="the engine's and transformers' device (vLLM: its build's)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="runs of each level per system, interleaved"
    )
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    ap.add_argument("--timeout", type=float, default=900.0, help="s for any one start or run")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning a core meanwhile")
    ap.add_argument("--baseline", default="", help="also run the engine as of this git ref")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"no model at {args.model}: run `omniflow models pull smollm2-135m-instruct`")
        return 2
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    dtypes = [d for d in args.dtypes.split(",") if d]
    # The spinners sit on the measured cores (the first ones), one core each.
    targets = bound_cores(args.threads) or sorted(os.sched_getaffinity(0))
    spinners = [
        multiprocessing.Process(target=_spin, args=(targets[i % len(targets)],), daemon=True)
        for i in range(args.busy)
    ]
    for s in spinners:
        s.start()
    load0 = os.getloadavg()
    rows = []
    try:
        for dtype in dtypes:
            rows += bench_dtype(args, dtype, levels)
    finally:
        for s in spinners:
            s.kill()
    load1 = os.getloadavg()
    print(
        f"\n{args.model.name}: prompt {args.prompt_len}, output {args.output_len}, greedy, "
        f"{args.threads} torch threads, busy processes {args.busy}, "
        f"load average before {load0[0]:.2f} after {load1[0]:.2f}"
    )
    base = f" | {'baseline':>8} | {'base/vLLM':>9}" if args.baseline else ""
    head = (
        f"{'dtype':>8} | {'concurrent':>10} | {'vLLM tok/s':>10} | {'Omni-Flow':>10} | "
        f"{'transformers':>12} | {'Omni/vLLM':>9} | {'same tokens':>11}{base}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        v = f"{r['vllm']:10.1f}" if r["vllm"] else f"{'-':>10}"
        h = f"{r['hf']:12.1f}" if r["hf"] else f"{'-':>12}"
        ratio = f"{r['ours'] / r['vllm']:8.2f}x" if r["vllm"] else f"{'-':>9}"
        # the first request's greedy tokens: how many leading ones equal vLLM's
        same = "-" if r["same"] is None else f"{r['same']}/{r['out']}"
        extra = ""
        if args.baseline:
            b = r["base"]
            br = f"{b / r['vllm']:8.2f}x" if r["vllm"] else f"{'-':>9}"
            extra = f" | {b:8.1f} | {br}"
        print(
            f"{r['dtype']:>8} | {r['n']:>10} | {v} | {r['ours']:10.1f} | {h} | {ratio} | "
            f"{same:>11}{extra}"
        )
    if args.baseline:
        print(f"baseline: the engine as of {args.baseline}")
    return 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bench_dtype(args: argparse.Namespace, dtype: str, levels: list[int]) -> list[dict]:
    """Every system of this dtype started once; then, level by level, ``--rounds`` rounds
    in which each system runs the level once, in turn (the order reversed every other
    round), the best run of each kept: a slow minute of a shared machine hits every
    system alike instead of whichever ran then."""
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = {n: prompts_for(n, args.prompt_len, vocab) for n in levels}
    peers: dict[str, Peer] = {}
    with tempfile.TemporaryDirectory(prefix="omniflow-bench-") as tmp:
        try:
            if not args.skip_vllm:
                peers["vllm"] = start_vllm(args, dtype, prompts)
            if args.baseline:
                peers["base"] = start_system(
                    args, dtype, prompts, "engine", args.baseline, Path(tmp)
                )
            peers["ours"] = start_system(args, dtype, prompts, "engine", "", Path(tmp))
            if not args.skip_hf:
                peers["hf"] = start_system(args, dtype, prompts, "hf", "", Path(tmp))
            best: dict[tuple[str, int], dict] = {}
            for n in levels:
                order = list(peers)
                for r in range(args.rounds):
                    for name in order if r % 2 == 0 else order[::-1]:
                        got = peers[name].run(n)
                        if got["tok_s"] > best.get((name, n), {"tok_s": -1.0})["tok_s"]:
                            best[name, n] = got
                print(
                    f"{dtype} {n}: " + " ".join(f"{k} {best[k, n]['tok_s']:.1f}" for k in peers),
                    flush=True,
                )
        finally:
            for peer in peers.values():
                peer.close()
    rows = []
    for n in levels:
        v = best.get(("vllm", n))
        ours = best["ours", n]
        rows.append(
            {
                "dtype": dtype,
                "n": n,
                "ours": ours["tok_s"],
                "hf": best["hf", n]["tok_s"] if ("hf", n) in best else 0.0,
                "vllm": v["tok_s"] if v else 0.0,
                "same": common_prefix(v["first"], ours["first"]) if v else None,
                "out": len(ours["first"]),
                "base": best["base", n]["tok_s"] if ("base", n) in best else 0.0,
            }
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
