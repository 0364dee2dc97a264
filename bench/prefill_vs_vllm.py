"""One request's prefill: the built-in engine against vLLM (CPU) on the same token ids.

Issue 19 item 3's time to first token, in process: a ``--prompt-lens`` token prompt (random
ids, one request at a time, prefix caching off on both) generated with ``max_tokens=1``, so
each run is one prefill plus one sampled token. vLLM drives ``LLM.generate`` in its own
virtualenv (``--vllm-python``); our engine runs ``Engine.step`` in a process of its own
(``adapt_threads`` off: the thread count stays the one asked for). Both are started once per
thread count, bound to the same first cores as ``bench/engine_vs_vllm.py`` binds them, then
take turns, ``--repeats`` runs each per prompt length. Printed per system: the wall time's
minimum and median, and the process CPU time's median (on a loaded machine the CPU time is
the steadier figure: it leaves out the time the scheduler gave to other processes), with
the load average before and after.

    python bench/prefill_vs_vllm.py                                  # 264 tokens, 2 then 1 thread
    python bench/prefill_vs_vllm.py --prompt-lens 256,512,1024 --threads 1 --repeats 10
    python bench/prefill_vs_vllm.py --prompt-lens 1024 --threads 1 --budget 512  # chunked
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_vs_vllm import DEFAULT_MODEL, DEFAULT_VLLM, Peer, bound_cores

# Both scripts end the same way: warm up on every prompt, then time the one named per line.
SERVE = r"""
for p in job["prompts"].values():
    go(p)
print("READY", flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    print("RESULT " + json.dumps(go(job["prompts"][line.strip()])), flush=True)
"""

VLLM_SCRIPT = (
    r"""
import json, sys, time
job = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
top = max(len(p) for p in job["prompts"].values())
llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=top + 16, seed=0,
          enable_prefix_caching=False, max_num_seqs=1,
          max_num_batched_tokens=job["budget"] or max(top, 2048))
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
def go(p):
    c, t = time.process_time(), time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return {"wall": wall, "cpu": cpu, "token": out[0].outputs[0].token_ids[0]}
"""
    + SERVE
)

# Our engine, in a process of its own bound like vLLM's threads.
ENGINE_SCRIPT = (
    r"""
import json, os, sys, time, torch
job = json.loads(sys.argv[1])
if job["cores"]:
    os.sched_setaffinity(0, job["cores"])
torch.set_num_threads(job["threads"])
from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest
from omniflow_services.worker.engine import SamplingParams
top = max(len(p) for p in job["prompts"].values())
cfg = EngineConfig(dtype=job["dtype"], num_pages=top // 16 + 8, enable_prefix_cache=False,
                   max_num_batched_tokens=job["budget"] or max(top, 2048), adapt_threads=False)
e = Engine(job["model"], cfg)
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
n = 0
def go(p):
    global n
    n += 1
    c, t = time.process_time(), time.perf_counter()
    e.add_request(GenerateRequest(f"r{n}", tuple(p), params=sp))
    toks = []
    while e.has_unfinished():
        for o in e.step():
            toks.extend(o.new_token_ids)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return {"wall": wall, "cpu": cpu, "token": toks[0]}
"""
    + SERVE
)


def prompt_of(length: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(19_000 + length)
    return [rng.randrange(3, vocab) for _ in range(length)]


def start(args: argparse.Namespace, system: str, threads: int, prompts: dict) -> Peer:
    cores = bound_cores(threads)
    job = {
        "model": str(args.model),
        "dtype": args.dtype,
        "prompts": {str(k): v for k, v in prompts.items()},
        "threads": threads,
        "cores": cores,
        "budget": args.budget,
    }
    env = dict(os.environ)
    if system == "engine":
        env["OMP_NUM_THREADS"] = str(threads)
        return Peer("engine", [sys.executable, "-c", ENGINE_SCRIPT, json.dumps(job)], env, 900)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The engine core in this process, so that its CPU time is the process's.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    bind = ",".join(map(str, cores)) if cores else "auto"
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    cmd = [str(args.vllm_python), "-c", VLLM_SCRIPT, json.dumps(job)]
    if cores:  # every vLLM process on the measured cores, as our engine's one process is
        cmd = ["taskset", "-c", bind, *cmd]
    return Peer("vLLM", cmd, env, 900)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-lens", default="264")
    ap.add_argument("--threads", default="2,1", help="thread counts, one pair of runs each")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    ap.add_argument(
        "--budget", type=int, default=0, help="tokens per step, both (0: the whole prompt)"
    )
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"no model at {args.model}: run `omniflow models pull smollm2-135m-instruct`")
        return 2
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    prompts = {n: prompt_of(n, vocab) for n in lens}
    systems = ["engine"] + ([] if args.skip_vllm else ["vllm"])
    rows = []
    for threads in (int(x) for x in args.threads.split(",") if x):
        load0 = os.getloadavg()[0]
        peers = {}
        try:
            for s in systems:
                peers[s] = start(args, s, threads, prompts)
            got: dict[tuple[str, int], list[dict]] = {}
            for n in lens:
                for r in range(args.repeats):
                    for s in systems if r % 2 == 0 else systems[::-1]:
                        got.setdefault((s, n), []).append(peers[s].run(n))
        finally:
            for p in peers.values():
                p.close()
        load1 = os.getloadavg()[0]
        for n in lens:
            row = {"threads": threads, "len": n, "load": (load0, load1)}
            for s in systems:
                runs = got[s, n]
                walls = [x["wall"] * 1e3 for x in runs]
                row[s] = (
                    min(walls),
                    statistics.median(walls),
                    statistics.median(x["cpu"] * 1e3 for x in runs),
                    runs[0]["token"],
                )
            rows.append(row)
    print(f"\n{args.model.name} {args.dtype}: one request, max_tokens=1, {args.repeats} runs each")
    head = (
        f"{'threads':>7} | {'tokens':>6} | {'ours min/med ms':>15} | {'ours cpu':>8} | "
        f"{'vLLM min/med ms':>15} | {'vLLM cpu':>8} | {'med ratio':>9} | {'token':>5} | load"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        o = r["engine"]
        v = r.get("vllm")
        vs = f"{v[0]:6.1f}/{v[1]:8.1f} | {v[2]:8.1f}" if v else f"{'-':>15} | {'-':>8}"
        ratio = f"{o[1] / v[1]:8.2f}x" if v else f"{'-':>9}"
        same = ("same" if o[3] == v[3] else "DIFF") if v else "-"
        print(
            f"{r['threads']:>7} | {r['len']:>6} | {o[0]:6.1f}/{o[1]:8.1f} | {o[2]:8.1f} | "
            f"{vs} | {ratio} | {same:>5} | {r['load'][0]:.2f} -> {r['load'][1]:.2f}"
        )
    print("ratio: our median wall time over vLLM's (below 1: ours is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
